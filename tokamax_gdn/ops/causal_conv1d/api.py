"""`causal_conv1d`: the user-facing function."""

from collections.abc import Sequence

import jax

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d import context_parallel


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None = None,
    *,
    activation: str | None = "silu",
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    segment_ids: jax.Array | None = None,
    implementation: str | Sequence[str] | None = None,
    context_parallel_axis: str | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Causal depthwise conv1d with optional SiLU, as in Mamba / Qwen3-Next.

    y[t, d] = act(bias[d] + sum_w weight[d, w] * x[t - (W-1) + w, d])

  Inputs before the first token come from `initial_state` (zeros if None).

  Dtypes: `x` sets the dtype of `y` and of the final state; `weight`, `bias`
  and `initial_state` may have any float dtype each. Every implementation
  computes in float32, and each gradient comes back in its input's dtype.

  Args:
    x: [B, T, D].
    weight: [D, W] (the `causal-conv1d` package layout; HF's Conv1d weight
      [D, 1, W] squeezed).
    bias: [D] or None.
    activation: "silu" (alias "swish") or None.
    initial_state: [B, W-1, D]: the W-1 inputs before x, oldest first.
    output_final_state: also return the last W-1 inputs [B, W-1, D] (x's
      dtype; zero-padded or taken from `initial_state` when T < W-1), ready
      to be passed as `initial_state` for the next tokens.
    segment_ids: [B, T] int; where the id changes the window restarts: no
      token sees inputs of an earlier segment, nor `initial_state`.
    implementation: None (best available), a name from
      `tokamax_gdn.registry.implementations("causal_conv1d")`, a `tokamax.Op`,
      or a sequence of those tried in order.
    context_parallel_axis: a mesh axis name, inside `jax.shard_map` with the
      time axis T of x/segment_ids sharded over it (device i holds tokens
      [i*T/P, (i+1)*T/P)). Each device reads the last W-1 inputs of the
      previous one (a ppermute); results equal the unsharded op's, with the
      final state on every device of the axis. Pass `weight`, `bias` and
      `initial_state` replicated over the axis. T must divide evenly over the
      axis, with at least W-1 tokens per device.

  Returns:
    (y [B, T, D] in x's dtype, final_state [B, W-1, D] or None).
  """
  if context_parallel_axis is not None:
    return context_parallel.causal_conv1d(
        x, weight, bias,
        axis_name=context_parallel_axis,
        activation=activation,
        initial_state=initial_state,
        output_final_state=output_final_state,
        segment_ids=segment_ids,
        implementation=implementation,
    )
  return registry.call(
      "causal_conv1d", implementation,
      x, weight, bias,
      activation=activation,
      initial_state=initial_state,
      output_final_state=output_final_state,
      segment_ids=segment_ids,
  )
