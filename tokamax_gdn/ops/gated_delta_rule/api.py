"""`gated_delta_rule`: the user-facing function."""

from collections.abc import Sequence

import jax

from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import context_parallel
from tokamax_gdn.ops.gated_delta_rule import remat


def gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm: bool = False,
    use_beta_sigmoid: bool = False,
    a_log: jax.Array | None = None,
    dt_bias: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    implementation: str | Sequence[str] | None = None,
    context_parallel_axis: str | None = None,
    named_residuals: bool = False,
) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule (Yang et al., ICLR 2025), as in Qwen3-Next / Qwen3.5.

  Per value head h (reading key head h // (Hv // Hk)) and token t:
    S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;
    o_t = scale * S_t^T q_t.

  Dtypes: `query`, `key` and `value` share one float dtype, `out`'s (a
  TypeError names them otherwise); `g`, `beta`, `a_log` and `dt_bias` may
  have any float dtype each. Every implementation computes in float32. The
  state is float32: an `initial_state` of another float dtype (a bfloat16
  cache, say) is cast to float32 (exactly, from bfloat16 or float16), and its
  gradient comes back in its own dtype.

  Args:
    query, key: [B, T, Hk, K].
    value: [B, T, Hv, V]; Hv a multiple of Hk.
    g: [B, T, Hv] log-decay (<= 0); or, with `a_log`, the raw gate, turned into
      -exp(a_log) * softplus(g + dt_bias) inside (with gradients for all three).
    beta: [B, T, Hv], in (0, 1); or, with `use_beta_sigmoid`, logits, turned
      into sigmoid(beta) inside (the gradient is the logits').
    scale: output scale; default K**-0.5.
    initial_state: [B, Hv, K, V] state before the first token (float32, or
      cast to it: see Dtypes). With
      `segment_ids` it may also be [B, N, Hv, K, V], one state per segment:
      segment n of row b (the n-th run of equal ids, from 0) starts from
      initial_state[b, n]; segments past the N-th start from zeros. Gradients
      flow to every segment's state.
    output_final_state: also return the state after the last token; for
      per-segment states, each segment's own end state.
    use_qk_l2norm: L2-normalise q and k (eps 1e-6) first.
    use_beta_sigmoid: `beta` holds logits (as a GatedDeltaNet's projection
      gives them); the Pallas kernels take the sigmoid and its VJP in VMEM,
      with no XLA pass over beta before or dbeta after them.
    a_log, dt_bias: [Hv] gate parameters (see `g`).
    segment_ids: [B, T] int; the state resets to zero where the id changes
      (or to the segment's own initial state, see `initial_state`). A NaN or
      inf in one segment's inputs or cotangents stays in that segment: its
      outputs and gradients become NaN, the other segments' do not change.
    implementation: None (best available for the backend), a name from
      `tokamax_gdn.registry.implementations("gated_delta_rule")`, a
      `tokamax.Op`, or a sequence of those tried in order (falling through on
      NotImplementedError).
    context_parallel_axis: a mesh axis name, inside `jax.shard_map` with the
      time axis T of query/key/value/g/beta/segment_ids sharded over it (in
      order: device i holds tokens [i*T/P, (i+1)*T/P)). Results equal the
      unsharded op's: each device's outputs for its tokens, and the final
      state of the whole sequence on every device of the axis. Pass
      `initial_state`, `a_log`, `dt_bias` replicated over the axis. T must
      divide evenly over the axis. See `context_parallel.py` for the method.
    named_residuals: the forward emits what the backward would recompute
      (chunk-entry states `gdn_chunk_states`, WY inverses `gdn_tmat`, and the
      output `gdn_out`) under those `checkpoint_name`s, for a
      `jax.checkpoint` policy to save, offload or recompute
      (`tokamax_gdn.ops.gated_delta_rule.remat`). Without `jax.checkpoint`
      they are kept from forward to backward (more memory, less compute).
      Not with `context_parallel_axis`.

  Returns:
    (out [B, T, Hv, V] in value's dtype, final_state float32 or None):
    final_state is [B, Hv, K, V], or [B, N, Hv, K, V] for per-segment states
    (zeros for the segments a row does not have). Every implementation
    computes in float32: float64 inputs give a float64 `out` and a float32
    state.

  Differentiable in reverse mode (jax.grad, jax.vjp, jax.jacrev); forward
  mode (jax.jvp, jax.jacfwd) raises `tokamax_gdn.ops.autodiff.ForwardModeError`
  (a TypeError naming the op).
  """
  kwargs = dict(scale=scale, initial_state=base.float32_state(initial_state),
                output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm,
                use_beta_sigmoid=use_beta_sigmoid, a_log=a_log, dt_bias=dt_bias,
                segment_ids=segment_ids)
  if named_residuals:
    if context_parallel_axis is not None:
      raise ValueError("named_residuals is not supported with context_parallel_axis")
    return registry.call_each(
        "gated_delta_rule", implementation,
        lambda op: remat.call(op, query, key, value, g, beta, **kwargs))
  if context_parallel_axis is not None:
    return context_parallel.gated_delta_rule(
        query, key, value, g, beta, axis_name=context_parallel_axis,
        implementation=implementation, **kwargs)
  return registry.call("gated_delta_rule", implementation, query, key, value, g, beta,
                       **kwargs)
