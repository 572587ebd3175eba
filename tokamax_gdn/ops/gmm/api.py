"""`gmm`: the user-facing function."""

from collections.abc import Sequence

import jax
from tokamax._src.ops import op as op_lib

from tokamax_gdn import registry


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    transpose_rhs: bool = False,
    implementation: str | op_lib.Op | Sequence[str | op_lib.Op] | None = None,
) -> jax.Array:
  """Grouped matmul, the forward of a mixture-of-experts layer.

  With offsets = cumsum([0, *group_sizes]), group g owns rows
  [offsets[g], offsets[g + 1]) of `lhs` and
    out[rows_g] = lhs[rows_g] @ rhs[g]      (or rhs[g]^T with `transpose_rhs`).
  Rows past sum(group_sizes) are zero. Same result as `jax.lax.ragged_dot`.

  Args:
    lhs: [M, K], float (incl. fp8) or int8.
    rhs: [G, K, N], or [G, N, K] with `transpose_rhs`.
    group_sizes: [G] integer, sum <= M.
    preferred_element_type: output dtype; default the operands' result type.
      Accumulation is float32 either way.
    transpose_rhs: read `rhs` as [G, N, K].
    implementation: None (best for the backend), a name from
      `tokamax_gdn.registry.implementations("gmm")`, a `tokamax.Op`, or a
      sequence of those tried in order (falling through on NotImplementedError).

  Returns:
    [M, N] in `preferred_element_type`.
  """
  return registry.call(
      "gmm", implementation, lhs, rhs, group_sizes,
      preferred_element_type=preferred_element_type,
      transpose_rhs=transpose_rhs,
  )
