"""XLA gmm: `jax.lax.ragged_dot_general`, float32 accumulation.

The VJP is gmm / tgmm of this same family (see `base.gmm_vjp_fn`).
"""

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.gmm import base


@dataclasses.dataclass(frozen=True)
class XlaGmm(base.Gmm[Any, Any]):
  """`jax.lax.ragged_dot_general` on operands converted to a common dtype."""

  vjp_family: ClassVar[str] = "xla"

  def _gmm(self, lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, config):
    del config
    ct = base.compute_dtype(lhs.dtype, rhs.dtype)
    dims = base.DIMS_TRANSPOSED_RHS if transpose_rhs else base.DIMS_PLAIN
    out = jax.lax.ragged_dot_general(
        lhs.astype(ct), rhs.astype(ct), group_sizes,
        ragged_dot_dimension_numbers=dims,
        precision=base.ragged_precision(ct),
        preferred_element_type=jnp.float32,
    )
    return out.astype(out_dtype)


IMPLEMENTATION = XlaGmm()
