"""Reference gmm: one masked dense matmul per group, float32.

  out = sum_g  where(row in group g, lhs @ rhs[g], 0)

The oracle for the other implementations: obvious, O(G) times the work,
differentiated by autodiff. The groups are a `lax.scan`, not a Python loop:
unrolled, 64 experts' forward and backward at MoE sizes took a minute to
compile on a TPU.
"""

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.gmm import base


def group_masks(group_sizes: jax.Array, m: int) -> jax.Array:
  """[G, M] bool: row r belongs to group g."""
  ends = jnp.cumsum(group_sizes)
  starts = ends - group_sizes
  rows = jnp.arange(m)
  return (rows[None, :] >= starts[:, None]) & (rows[None, :] < ends[:, None])


class ReferenceGmm(base.Gmm[Any, Any]):
  """Per-group masked loop in float32."""

  def _gmm(self, lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, config):
    del config
    lhs32 = lhs.astype(jnp.float32)
    rhs32 = rhs.astype(jnp.float32)
    if transpose_rhs:
      rhs32 = jnp.swapaxes(rhs32, 1, 2)
    masks = group_masks(group_sizes, lhs.shape[0])
    # Rows past sum(group_sizes) are ignored: selected out before the
    # matmuls, so that their NaN / inf reaches neither the output nor (as
    # 0 * NaN in lhs^T @ d_out) the rhs gradient.
    lhs32 = jnp.where(jnp.any(masks, axis=0)[:, None], lhs32, 0.0)

    def add_group(out, xs):
      rhs_g, mask_g = xs
      prod = jnp.dot(lhs32, rhs_g, precision=jax.lax.Precision.HIGHEST)
      return out + jnp.where(mask_g[:, None], prod, 0.0), None

    out = jnp.zeros((lhs.shape[0], rhs32.shape[2]), jnp.float32)
    out, _ = jax.lax.scan(add_group, out, (rhs32, masks))
    return out.astype(out_dtype)


IMPLEMENTATION = ReferenceGmm()
