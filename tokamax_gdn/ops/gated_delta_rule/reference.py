"""Reference gated delta rule: the per-token recurrence, float32, `lax.scan`.

  S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = scale S_t^T q_t

The oracle for every other implementation: obvious, slow, differentiated by
autodiff through the scan.
"""

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.gated_delta_rule import base


class ReferenceGatedDeltaRule(base.GatedDeltaRule[Any, Any]):
  """Per-token recurrence in float32."""

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
    s0 = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None
          else f32(initial_state))
    starts = base.segment_starts(segment_ids, t)
    if starts is None:
      starts = jnp.zeros((b, t), bool)

    # HIGHEST: on TPU the default matmul precision rounds f32 operands to bf16,
    # which an oracle cannot afford.
    einsum = lambda *a: jnp.einsum(*a, precision=jax.lax.Precision.HIGHEST)

    def step(s, xs):
      q_t, k_t, v_t, g_t, beta_t, start_t = xs        # [B,Hv,K] ... [B]
      s = jnp.where(start_t[:, None, None, None], 0.0, s)
      s = jnp.exp(g_t)[..., None, None] * s
      pred = einsum("bhk,bhkv->bhv", k_t, s)
      s = s + einsum("bhk,bhv->bhkv", beta_t[..., None] * k_t, v_t - pred)
      o_t = scale * einsum("bhkv,bhk->bhv", s, q_t)
      return s, o_t

    time_major = lambda x: jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (q, k, v, log_decay, beta, starts)))
    final_state, out = jax.lax.scan(step, s0, xs)
    return time_major(out), final_state, None


IMPLEMENTATION = ReferenceGatedDeltaRule()
