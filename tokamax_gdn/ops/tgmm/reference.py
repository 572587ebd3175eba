"""Reference tgmm: one masked dense matmul per group, float32.

  out[g] = (where(row in group g, lhs, 0))^T @ where(row in a group, rhs, 0)

The oracle for the other implementations; differentiated by autodiff. The
groups are a `lax.map` (one compiled body), as in the gmm reference.
"""

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.gmm.reference import group_masks
from tokamax_gdn.ops.tgmm import base


class ReferenceTgmm(base.Tgmm[Any, Any]):
  """Per-group masked loop in float32."""

  def _tgmm(self, lhs, rhs, group_sizes, *, out_dtype, config):
    del config
    lhs32 = lhs.astype(jnp.float32)
    rhs32 = rhs.astype(jnp.float32)
    masks = group_masks(group_sizes, lhs.shape[0])
    # Rows past sum(group_sizes) are ignored: both operands selected out
    # (a masked lhs row times a NaN rhs row would still be 0 * NaN).
    rhs32 = jnp.where(jnp.any(masks, axis=0)[:, None], rhs32, 0.0)

    def group(mask_g):
      masked = jnp.where(mask_g[:, None], lhs32, 0.0)
      return jnp.dot(masked.T, rhs32, precision=jax.lax.Precision.HIGHEST)

    return jax.lax.map(group, masks).astype(out_dtype)


IMPLEMENTATION = ReferenceTgmm()
