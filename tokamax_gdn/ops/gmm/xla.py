"""XLA gmm: `jax.lax.ragged_dot_general` (`base.ragged_dot`), float32 accumulation.

The VJP is gmm / tgmm of this same family (see `base.gmm_vjp_fn`).
"""

import dataclasses
from typing import Any, ClassVar


from tokamax_gdn.ops.gmm import base


@dataclasses.dataclass(frozen=True)
class XlaGmm(base.Gmm[Any, Any]):
  """`jax.lax.ragged_dot_general` on operands converted to a common dtype."""

  vjp_family: ClassVar[str] = "xla"

  def _gmm(self, lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, config):
    del config
    ct = base.compute_dtype(lhs.dtype, rhs.dtype)
    dims = base.DIMS_TRANSPOSED_RHS if transpose_rhs else base.DIMS_PLAIN
    out = base.ragged_dot(lhs, rhs, group_sizes, dims, ct)
    return out.astype(out_dtype)


IMPLEMENTATION = XlaGmm()
