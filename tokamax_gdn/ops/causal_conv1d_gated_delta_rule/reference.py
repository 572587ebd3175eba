"""Reference serving GDN: one `lax.scan` over the ragged token axis, float32.

The oracle for the other implementations: token by token, in order, exactly
the module docstring of `base.py`. The carry holds both pools and the current
request's conv window and state; at a request's first token they are loaded
from its read slot (or zeros), after each token the step of
`gated_delta_rule/reference.py` runs on it, and the token's checkpoint (if it
has one) is stored into its slot with a one-slot `dynamic_update_slice`.
Tokens of no valid request pass the carry through unchanged.
"""

from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import prologue as gdn_prologue

_HIGHEST = jax.lax.Precision.HIGHEST


def _put(pool, slot, value, write):
  """pool with `value` at `slot` where `write`, else unchanged (one slot)."""
  old = jax.lax.dynamic_index_in_dim(pool, slot, keepdims=False)
  new = jnp.where(write, value.astype(pool.dtype), old)
  return jax.lax.dynamic_update_index_in_dim(pool, new, slot, axis=0)


class ReferenceCausalConv1dGatedDeltaRule(base.CausalConv1dGatedDeltaRule[Any, Any]):
  """Per-token scan in float32."""

  def _serve(self, qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
             dt_bias, reqs, *, dims, config):
    del config
    t_len = qkv.shape[0]
    n_req = reqs.start.shape[0]
    taps = base.conv_weight_taps(conv_weight)                            # [W, D]
    bias = (jnp.zeros((dims.dim,), jnp.float32) if conv_bias is None
            else conv_bias.astype(jnp.float32))
    beta_all, g_all = base.gates(b, a, a_log, dt_bias)
    group = dims.n_v // dims.n_kq

    # Token -> request (the last valid request starting at or before it).
    token = jnp.arange(t_len, dtype=jnp.int32)
    began = reqs.valid[None, :] & (reqs.start[None, :] <= token[:, None])     # [T, R]
    owner = jnp.max(jnp.where(began, jnp.arange(n_req)[None, :], 0), axis=1)
    pos = token - reqs.start[owner]
    owned = reqs.valid[owner] & (pos >= 0) & (pos < reqs.length[owner])

    def step(carry, xs):
      conv_pool, rec_pool, window, s = carry
      x_t, beta_t, g_t, r, p, live = xs
      first = live & (p == 0)
      init = reqs.has_init[r]
      read = reqs.read_slot[r]
      conv0 = jax.lax.dynamic_index_in_dim(conv_pool, read, keepdims=False).astype(jnp.float32)
      rec0 = jax.lax.dynamic_index_in_dim(rec_pool, read, keepdims=False).astype(jnp.float32)
      window = jnp.where(first, jnp.where(init, conv0, 0.0), window)
      s = jnp.where(first, jnp.where(init, rec0, 0.0), s)

      xp = jnp.concatenate([window, x_t.astype(jnp.float32)[None]], axis=0)   # [W, D]
      act = jax.nn.silu(bias + jnp.sum(taps * xp, axis=0))
      q, k, v = base.split_heads(act, dims)
      q = jnp.repeat(gdn_prologue.l2norm(q), group, axis=0)
      k = jnp.repeat(gdn_prologue.l2norm(k), group, axis=0)
      s_new = jnp.exp(g_t)[:, None, None] * s
      pred = jnp.einsum("hk,hkv->hv", k, s_new, precision=_HIGHEST)
      s_new = s_new + jnp.einsum("hk,hv->hkv", beta_t[:, None] * k, v - pred,
                                 precision=_HIGHEST)
      o_t = dims.scale * jnp.einsum("hkv,hk->hv", s_new, q, precision=_HIGHEST)
      window_new = xp[1:]

      # Checkpoint: decode requests keep their last `num_checkpoints` states,
      # the others their final one (num_checkpoints = 1).
      from_end = reqs.length[r] - 1 - p
      ckpt = live & (from_end < reqs.num_checkpoints[r])
      slot = reqs.write_slot[r] + reqs.num_checkpoints[r] - 1 - from_end
      slot = jnp.clip(slot, 0, rec_pool.shape[0] - 1)
      conv_pool = _put(conv_pool, slot, window_new, ckpt)
      rec_pool = _put(rec_pool, slot, s_new, ckpt)
      window = jnp.where(live, window_new, window)
      s = jnp.where(live, s_new, s)
      out_t = jnp.where(live, o_t.reshape(-1), 0.0)
      return (conv_pool, rec_pool, window, s), out_t

    carry = (conv_state, recurrent_state,
             jnp.zeros((dims.kernel_size - 1, dims.dim), jnp.float32),
             jnp.zeros((dims.n_v, dims.d_k, dims.d_v), jnp.float32))
    (conv_pool, rec_pool, _, _), out = jax.lax.scan(
        step, carry, (qkv, beta_all, g_all, owner, pos, owned))
    return (conv_pool, rec_pool), out


IMPLEMENTATION = ReferenceCausalConv1dGatedDeltaRule()
