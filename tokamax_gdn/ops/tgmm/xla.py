"""XLA tgmm: `jax.lax.ragged_dot_general` with a ragged contracting dimension.

The VJP is gmm of this same family (see `base.tgmm_vjp_fn`).
"""

import dataclasses
from typing import Any, ClassVar


from tokamax_gdn.ops.gmm import base as gmm_base
from tokamax_gdn.ops.tgmm import base


@dataclasses.dataclass(frozen=True)
class XlaTgmm(base.Tgmm[Any, Any]):
  """`jax.lax.ragged_dot_general` on operands converted to a common dtype."""

  vjp_family: ClassVar[str] = "xla"

  def _tgmm(self, lhs, rhs, group_sizes, *, out_dtype, config):
    del config
    ct = gmm_base.compute_dtype(lhs.dtype, rhs.dtype)
    out = gmm_base.ragged_dot(lhs, rhs, group_sizes, base.DIMS, ct)
    return out.astype(out_dtype)


IMPLEMENTATION = XlaTgmm()
