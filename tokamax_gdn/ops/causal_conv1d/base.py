"""Causal depthwise conv1d: the Op every implementation derives from.

Per batch b, channel d and token t, with W taps and `xp` = [state; x] (the
W-1 inputs before the first token, oldest first, then x):

  pre[t, d] = bias[d] + sum_{w<W} weight[d, w] * xp[t + w, d] * valid(t, W-1-w)
  y[t, d]   = silu(pre[t, d])            (or pre itself when activation=None)

Tap w reads the input s = W-1-w tokens back. `valid(t, s)` is 1 unless
`segment_ids` says a new segment started in (t-s, t]: a window never sees
tokens of an earlier segment, nor the initial state once a segment has changed.
As a per-token integer: valid(t, s) = s <= reach[t], reach[t] = t - start(t)
(start(t): first token of t's segment) for every segment but the first, where
the initial state is visible and reach[t] = W-1.

Final state: the last W-1 inputs of [state-or-zeros; x] (so zero-padded, or
the tail of the initial state, when T < W-1, as the `causal-conv1d` package
does), with the rows before the last segment's start zeroed. It has x's dtype
(like `causal-conv1d`'s `final_states`): it holds raw inputs, so nothing is
lost by keeping their dtype.

Split of work: `CausalConv1d.bind` validates once; `_fwd` computes `reach` and
the final state for every backend; backends implement `_conv`.
"""

from typing import Any, ClassVar, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member
from tokamax._src.ops import op

from tokamax_gdn.autotuning import ShippedAutotuningCacheMixin
from tokamax_gdn.ops import checks
from tokamax_gdn.ops import autodiff
from tokamax_gdn.ops import segments

AbstractArray = jax.ShapeDtypeStruct | jax.core.ShapedArray
Output: TypeAlias = tuple[jax.Array, jax.Array | None]
Residuals: TypeAlias = Any

ACTIVATIONS = ("silu", None)


def canonical_activation(activation: str | None) -> str | None:
  if activation in ("silu", "swish"):
    return "silu"
  if activation in (None, "identity", "none"):
    return None
  raise ValueError(f"`activation`={activation!r}: expected 'silu' or None.")


def activate(pre: jax.Array, activation: str | None) -> jax.Array:
  return jax.nn.silu(pre) if activation == "silu" else pre


def window_reach(segment_ids: jax.Array | None, width: int) -> jax.Array | None:
  """[B, T] int32: the largest look-back s (0..W-1) token t may read (see module doc)."""
  if segment_ids is None:
    return None
  pos = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)[None, :]
  starts = segments.segment_starts(segment_ids)
  start = segments.segment_first(starts)
  first_segment = jnp.cumsum(starts.astype(jnp.int32), axis=1) == 0
  reach = jnp.where(first_segment, width - 1, jnp.minimum(pos - start, width - 1))
  return reach.astype(jnp.int32)


def padded_input(x: jax.Array, initial_state: jax.Array | None, width: int) -> jax.Array:
  """[state-or-zeros; x] as float32, [B, T + W - 1, D]."""
  b, _, d = x.shape
  state = (jnp.zeros((b, width - 1, d), jnp.float32) if initial_state is None
           else initial_state.astype(jnp.float32))
  return jnp.concatenate([state, x.astype(jnp.float32)], axis=1)


def final_state(x: jax.Array, initial_state: jax.Array | None,
                segment_ids: jax.Array | None, width: int) -> jax.Array:
  """The last W-1 inputs [B, W-1, D] in x's dtype, masked to the last segment."""
  t = x.shape[1]
  xp = padded_input(x, initial_state, width)
  state = xp[:, t:]
  if segment_ids is not None and t > 0:
    # Row j holds position t-(W-1)+j: W-2-j tokens before the last one, so a
    # token right after the sequence sees it iff the last token could.
    reach_last = window_reach(segment_ids, width)[:, -1]               # [B]
    look_back = (width - 2) - jnp.arange(width - 1)
    visible = look_back[None, :] <= reach_last[:, None]
    state = jnp.where(visible[..., None], state, 0.0)
  return state.astype(x.dtype)


class CausalConv1d[C, K](autodiff.ReverseModeOnly, ShippedAutotuningCacheMixin,
                        op.Op[Any, Output, Residuals, C, K]):
  """Causal depthwise conv1d. Subclasses implement `_conv`."""

  forward_mode_name: ClassVar[str] = "causal_conv1d"

  # W above this: NotImplementedError, so `implementation=` falls through.
  max_width: ClassVar[int | None] = None

  def bind(
      self,
      x: Float[Array | AbstractArray, "B T D"],
      weight: Float[Array | AbstractArray, "D W"],
      bias: Float[Array | AbstractArray, "D"] | None = None,
      *,
      activation: str | None = "silu",
      initial_state: Float[Array | AbstractArray, "B Wm1 D"] | None = None,
      output_final_state: bool = False,
      segment_ids: Int[Array | AbstractArray, "B T"] | None = None,
      return_residuals: bool = False,
  ) -> op.BoundArguments:
    """Checks shapes and dtypes once for every backend."""
    if x.ndim != 3:
      raise ValueError(f"{checks.describe('x', x)}: expected rank 3 ([batch, time, channels]).")
    checks.require_float("x", x)
    b, t, d = x.shape
    if weight.ndim != 2 or weight.shape[0] != d or weight.shape[1] < 1:
      raise ValueError(
          f"{checks.describe('weight', weight)}: expected shape ({d}, W) ([channels, width],"
          f" channels from `x`).")
    checks.require_float("weight", weight)
    width = weight.shape[1]
    if bias is not None:
      checks.require_float("bias", bias)
      checks.require_shape("bias", bias, (d,), "[D]")
    if initial_state is not None:
      checks.require_float("initial_state", initial_state)
      checks.require_shape("initial_state", initial_state, (b, width - 1, d), "[B, W-1, D]")
    if segment_ids is not None:
      if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"{checks.describe('segment_ids', segment_ids)} must be integer.")
      checks.require_shape("segment_ids", segment_ids, (b, t), "[B, T]")
    activation = canonical_activation(activation)
    if self.max_width is not None and width > self.max_width:
      raise NotImplementedError(
          f"{type(self).__name__} supports widths up to {self.max_width}; got W={width}.")
    return super().bind(
        x, weight, bias,
        activation=activation,
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        segment_ids=segment_ids,
        return_residuals=return_residuals,
    )

  def _fwd(
      self,
      x: Float[Array, "B T D"],
      weight: Float[Array, "D W"],
      bias: Float[Array, "D"] | None,
      *,
      activation: str | None,
      initial_state: Float[Array, "B Wm1 D"] | None,
      output_final_state: bool,
      segment_ids: Int[Array, "B T"] | None,
      return_residuals: bool,
      config: C,
  ) -> tuple[Output, Residuals]:
    width = weight.shape[1]
    reach = window_reach(segment_ids, width)
    y = self._conv(x, weight, bias, activation=activation,
                   initial_state=initial_state, reach=reach, config=config)
    fs = final_state(x, initial_state, segment_ids, width) if output_final_state else None
    return (y.astype(x.dtype), fs), None

  def _conv(
      self,
      x: jax.Array,
      weight: jax.Array,
      bias: jax.Array | None,
      *,
      activation: str | None,
      initial_state: jax.Array | None,
      reach: jax.Array | None,
      config: C,
  ) -> jax.Array:
    """Returns y [B, T, D] (any float dtype; cast to x's by `_fwd`)."""
    raise NotImplementedError
