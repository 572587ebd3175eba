"""Reference gated delta rule: the per-token recurrence, float32, `lax.scan`.

  S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = scale S_t^T q_t

The oracle for every other implementation: obvious, slow, differentiated by
autodiff through the scan. At a segment start S is replaced (a select, never a
multiply by zero) by zeros, or, for per-segment states, by
initial_state[b, n] (zeros past the N-th segment); the state after the last
token of segment n < N is its final state.

Float64 inputs run in float32 like every implementation (one state layout,
float32, for all of them; the numerical contract, docs/design.md, is float32) and return out in
float64.
"""

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import base


class ReferenceGatedDeltaRule(base.GatedDeltaRule[Any, Any]):
  """Per-token recurrence in float32."""

  supports_segment_states = True

  def _core_fwd(self, q, k, v, log_decay, beta, *, scale, initial_state,
                segment_ids, config):
    del config
    b, t, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    f32 = lambda x: x.astype(jnp.float32)
    # GVA: value head h reads key head h // (Hv // Hk).
    q = jnp.repeat(f32(q), hv // hk, axis=2)
    k = jnp.repeat(f32(k), hv // hk, axis=2)
    v, log_decay, beta = f32(v), f32(log_decay), f32(beta)
    zeros = jnp.zeros((b, hv, dk, dv), jnp.float32)
    per_segment = initial_state is not None and initial_state.ndim == 5
    if segment_ids is None:
      starts = seg = jnp.zeros((b, t), bool)
    else:
      starts = segments.segment_starts(segment_ids)
      seg = segments.segment_index(segment_ids)

    if per_segment:
      states = f32(initial_state)                               # [B, N, Hv, K, V]
      s0 = states[:, 0]
      ends = segments.segment_ends(starts)

      def restart(seg_t):
        return segments.state_of_segment(states, seg_t)
    else:
      s0 = zeros if initial_state is None else f32(initial_state)
      ends = seg

      def restart(seg_t):
        del seg_t
        return zeros

    # HIGHEST: on TPU the default matmul precision rounds f32 operands to bf16,
    # which an oracle cannot afford.
    einsum = lambda *a: jnp.einsum(*a, precision=jax.lax.Precision.HIGHEST)

    def step(carry, xs):
      s, finals = carry
      q_t, k_t, v_t, g_t, beta_t, start_t, seg_t, end_t = xs        # [B,Hv,K] ... [B]
      s = jnp.where(start_t[:, None, None, None], restart(seg_t), s)
      s = jnp.exp(g_t)[..., None, None] * s
      pred = einsum("bhk,bhkv->bhv", k_t, s)
      s = s + einsum("bhk,bhv->bhkv", beta_t[..., None] * k_t, v_t - pred)
      o_t = scale * einsum("bhkv,bhk->bhv", s, q_t)
      if per_segment:
        finals = segments.store_segment_state(finals, seg_t, s, end_t)
      return (s, finals), o_t

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (q, k, v, log_decay, beta, starts, seg, ends)))
    finals = jnp.zeros_like(states) if per_segment else None
    (final_state, finals), out = jax.lax.scan(step, (s0, finals), xs)
    return time_major(out), finals if per_segment else final_state, None


IMPLEMENTATION = ReferenceGatedDeltaRule()
