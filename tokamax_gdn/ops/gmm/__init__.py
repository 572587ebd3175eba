"""Grouped matmul: out[rows of group g] = lhs[rows] @ rhs[g] (as `jax.lax.ragged_dot`)."""
