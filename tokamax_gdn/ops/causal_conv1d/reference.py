"""Reference causal conv1d: one window per token, float32, autodiff backward.

  y[t] = act(bias + sum_w weight[:, w] * xp[t + w] * (W-1-w <= reach[t]))

The oracle for every other implementation: obvious and slow (it gathers a
[B, T, W, D] window tensor).
"""

from typing import Any

import jax.numpy as jnp

from tokamax_gdn.ops.causal_conv1d import base


class ReferenceCausalConv1d(base.CausalConv1d[Any, Any]):
  """Explicit per-token windows in float32."""

  def _conv(self, x, weight, bias, *, activation, initial_state, reach, config):
    del config
    t = x.shape[1]
    width = weight.shape[1]
    xp = base.padded_input(x, initial_state, width)                  # [B, T+W-1, D]
    idx = jnp.arange(t)[:, None] + jnp.arange(width)[None, :]         # [T, W]
    windows = xp[:, idx]                                              # [B, T, W, D]
    if reach is not None:
      look_back = (width - 1) - jnp.arange(width)                     # [W]
      visible = look_back[None, None, :] <= reach[:, :, None]          # [B, T, W]
      windows = jnp.where(visible[..., None], windows, 0.0)
    pre = jnp.einsum("btwd,dw->btd", windows, weight.astype(jnp.float32))
    if bias is not None:
      pre = pre + bias.astype(jnp.float32)
    return base.activate(pre, activation)


IMPLEMENTATION = ReferenceCausalConv1d()
