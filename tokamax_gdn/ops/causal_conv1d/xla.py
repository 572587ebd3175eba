"""Causal conv1d in plain JAX: W shifted multiply-adds, fused by XLA.

  pre = bias + sum_w weight[:, w] * xp[w : w + T] * mask_w,   y = act(pre)

with xp = [state; x] and mask_w the segment mask for look-back W-1-w. Each
shift is a slice of the same padded array, so XLA fuses the whole sum (and its
autodiff backward, which is the same pattern with the shifts reversed) into
one elementwise pass; there is no matmul worth calling a convolution for at
depthwise widths of 2..8.
"""

from typing import Any

import jax.numpy as jnp

from tokamax_gdn.ops.causal_conv1d import base


class XlaCausalConv1d(base.CausalConv1d[Any, Any]):
  """Shifted multiply-adds in float32."""

  def _conv(self, x, weight, bias, *, activation, initial_state, reach, config):
    del config
    t = x.shape[1]
    width = weight.shape[1]
    xp = base.padded_input(x, initial_state, width)
    w32 = weight.astype(jnp.float32)
    pre = jnp.zeros(x.shape, jnp.float32) if bias is None else jnp.broadcast_to(
        bias.astype(jnp.float32), x.shape)
    for w in range(width):
      term = xp[:, w:w + t] * w32[:, w]
      if reach is not None and w < width - 1:   # look-back 0 is always visible
        term = jnp.where((width - 1 - w <= reach)[..., None], term, 0.0)
      pre = pre + term
    return base.activate(pre, activation)


IMPLEMENTATION = XlaCausalConv1d()
