"""`tgmm`: the user-facing function."""

from collections.abc import Sequence

import jax
from tokamax._src.ops import op as op_lib

from tokamax_gdn import registry


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    implementation: str | op_lib.Op | Sequence[str | op_lib.Op] | None = None,
) -> jax.Array:
  """Transposed grouped matmul: the weight gradient of `gmm`.

  With offsets = cumsum([0, *group_sizes]) and rows_g = [offsets[g], offsets[g+1]):
    out[g] = lhs[rows_g]^T @ rhs[rows_g].
  Rows past sum(group_sizes) are ignored; empty groups give zeros. Same result
  as `jax.lax.ragged_dot_general` with a ragged contracting dimension.

  Args:
    lhs: [M, K], float (incl. fp8) or int8.
    rhs: [M, N], float (incl. fp8) or int8.
    group_sizes: [G] integer, sum <= M.
    preferred_element_type: output dtype; default the operands' result type.
      Accumulation is float32 either way.
    implementation: None, a name from `tokamax_gdn.registry.implementations("tgmm")`,
      a `tokamax.Op`, or a sequence of those tried in order.

  Returns:
    [G, K, N] in `preferred_element_type`.
  """
  return registry.call(
      "tgmm", implementation, lhs, rhs, group_sizes,
      preferred_element_type=preferred_element_type,
  )
