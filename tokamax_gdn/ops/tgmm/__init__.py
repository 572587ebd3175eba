"""Transposed grouped matmul: out[g] = lhs[rows_g]^T @ rhs[rows_g] (gmm's weight gradient)."""
