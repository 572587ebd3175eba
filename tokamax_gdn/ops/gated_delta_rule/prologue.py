"""Gated delta rule prologue: per-token preparation shared by every backend.

q, k are L2-normalised (x / sqrt(sum x^2 + 1e-6), in float32) when
`use_qk_l2norm`; the log-decay is g itself, or -exp(a_log) * softplus(g +
dt_bias) when `a_log` / `dt_bias` are given, floored for chunked backends
(`CHUNKED_LOG_DECAY_FLOOR`); beta is sigmoid(beta) in float32 when
`use_beta_sigmoid` (the op's `beta` then holds logits: `beta_sigmoid`). It is
pointwise per token, runs in XLA before the core and is differentiated by
autodiff (`base.GatedDeltaRuleVjp`), except in cores that run it themselves
(`prologue_in_core`: the Pallas kernels, which call these same functions on
their tiles).
"""

import jax
import jax.numpy as jnp

L2NORM_EPS = 1e-6

# Chunked implementations add log-decays into an in-chunk cumsum G and take
# exp(G_i - G_j). A very negative gate (a "forget": -1e4 from a large raw gate)
# makes |G| large, and float32 cancellation in G_i - G_j then loses the small
# decays after it. Flooring the log-decay at -30 bounds |G| and changes the
# result by at most exp(-30) ~ 1e-13 relative (the state is multiplied by
# ~0 either way); the floored tokens get a zero gate gradient (true: < 1e-13).
CHUNKED_LOG_DECAY_FLOOR = -30.0


def l2norm(x: jax.Array) -> jax.Array:
  """x / sqrt(sum(x^2) + 1e-6) over the last axis, computed in float32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2NORM_EPS)


def beta_sigmoid(beta: jax.Array) -> jax.Array:
  """The write strengths from logits: sigmoid(beta) in float32."""
  return jax.nn.sigmoid(beta.astype(jnp.float32))


def gate_log_decay(
    g: jax.Array, a_log: jax.Array | None, dt_bias: jax.Array | None
) -> jax.Array:
  """Log-decay in float32: g itself, or -exp(a_log) * softplus(g + dt_bias)."""
  g = g.astype(jnp.float32)
  if a_log is None:
    return g
  if dt_bias is not None:
    g = g + dt_bias.astype(jnp.float32)
  return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(g)


def prologue(
    query: jax.Array,
    key: jax.Array,
    g: jax.Array,
    a_log: jax.Array | None,
    dt_bias: jax.Array | None,
    *,
    use_qk_l2norm: bool,
    log_decay_floor: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-token preparation shared by every backend: (q, k, log_decay).

  q and k keep the input dtype (normalised in float32 first); the log-decay is
  float32, floored at `log_decay_floor` when given.
  """
  if use_qk_l2norm:
    query = l2norm(query).astype(query.dtype)
    key = l2norm(key).astype(key.dtype)
  log_decay = gate_log_decay(g, a_log, dt_bias)
  if log_decay_floor is not None:
    log_decay = jnp.maximum(log_decay, log_decay_floor)
  return query, key, log_decay
