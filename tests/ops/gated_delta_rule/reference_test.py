"""The GDN reference against an independent float64 NumPy per-token loop."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs


def numpy_gdn(q, k, v, g, beta, *, scale, h0, l2norm, a_log, dt_bias, seg):
  """docs/gdn_math.md's recurrence, written out in float64."""
  q, k, v, g, beta = (np.asarray(x, np.float64) for x in (q, k, v, g, beta))
  b, t, hk, dk = q.shape
  hv, dv = v.shape[2:]
  if l2norm:
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
  if a_log is not None:
    x = g + np.asarray(dt_bias, np.float64)
    g = -np.exp(np.asarray(a_log, np.float64)) * np.log1p(np.exp(x))
  out = np.zeros((b, t, hv, dv))
  final = np.zeros((b, hv, dk, dv))
  for bi in range(b):
    for h in range(hv):
      kh = h // (hv // hk)
      s = np.zeros((dk, dv)) if h0 is None else np.asarray(h0[bi, h], np.float64)
      for ti in range(t):
        if seg is not None and ti > 0 and seg[bi, ti] != seg[bi, ti - 1]:
          s = np.zeros((dk, dv))
        s = np.exp(g[bi, ti, h]) * s
        kt = k[bi, ti, kh]
        s = s + beta[bi, ti, h] * np.outer(kt, v[bi, ti, h] - kt @ s)
        out[bi, ti, h] = scale * s.T @ q[bi, ti, kh]
      final[bi, h] = s
  return out, final


def _max_rel(a, e):
  a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
  return np.max(np.abs(a - e)) / max(np.max(np.abs(e)), 1e-30)


@pytest.mark.parametrize(
    "t,hk,hv,l2norm,gate,h0,segments,g_mode",
    [
        (1, 1, 2, False, False, True, 0, "normal"),
        (37, 1, 2, True, False, True, 0, "normal"),
        (29, 1, 4, False, True, False, 0, "normal"),
        (45, 2, 4, True, True, True, 4, "normal"),
        (33, 2, 8, False, False, True, 0, "zero_half"),
        (21, 1, 1, True, False, True, 2, "very_negative"),
    ],
)
def test_reference_matches_float64_loop(t, hk, hv, l2norm, gate, h0, segments, g_mode):
  (q, k, v, g, beta), kw = random_inputs(
      jax.random.key(t * 7 + hv), b=2, t=t, hk=hk, hv=hv, dk=8, dv=6,
      gate=gate, initial_state=h0, segments=segments)
  if g_mode == "zero_half":
    g = jnp.where(jnp.arange(t)[None, :, None] % 2 == 0, 0.0, g)
  elif g_mode == "very_negative":
    g = jnp.where(jnp.arange(t)[None, :, None] % 3 == 0, -80.0, g)
  kw["output_final_state"] = True
  arrays = {n: x for n, x in kw.items() if n != "output_final_state"}
  # Jitted: one compile (eager dispatch compiles each primitive of the scan).
  out, final = jax.jit(lambda q, k, v, g, beta, arrays: tokamax_gdn.gated_delta_rule(
      q, k, v, g, beta, use_qk_l2norm=l2norm, output_final_state=True,
      implementation="reference", **arrays))(q, k, v, g, beta, arrays)
  exp_out, exp_final = numpy_gdn(
      q, k, v, g, beta, scale=8**-0.5, h0=kw.get("initial_state"), l2norm=l2norm,
      a_log=kw.get("a_log"), dt_bias=kw.get("dt_bias"), seg=kw.get("segment_ids"))
  assert _max_rel(out, exp_out) < 1e-5
  assert _max_rel(final, exp_final) < 1e-5


def test_explicit_scale_and_dtype():
  (q, k, v, g, beta), _ = random_inputs(jax.random.key(3), b=1, t=9, hk=1, hv=1,
                                         dk=4, dv=4, dtype=jnp.bfloat16,
                                         initial_state=False)
  out, final = tokamax_gdn.gated_delta_rule(q, k, v, g, beta, scale=0.3,
                                            implementation="reference")
  assert out.dtype == jnp.bfloat16 and final is None
  exp_out, _ = numpy_gdn(q, k, v, g, beta, scale=0.3, h0=None, l2norm=False,
                         a_log=None, dt_bias=None, seg=None)
  assert _max_rel(out, exp_out) < 1e-2


def test_initial_state_gradient_is_real():
  (q, k, v, g, beta), kw = random_inputs(jax.random.key(5), b=1, t=5, hk=1, hv=1,
                                          dk=4, dv=4)
  h0 = kw["initial_state"]
  f = lambda h: jnp.sum(tokamax_gdn.gated_delta_rule(
      q, k, v, g, beta, initial_state=h, implementation="reference")[0])
  grad = jax.grad(f)(h0)
  eps = 1e-3
  e = jnp.zeros_like(h0).at[0, 0, 1, 2].set(eps)
  fd = (f(h0 + e) - f(h0 - e)) / (2 * eps)
  assert float(jnp.abs(grad).max()) > 0
  np.testing.assert_allclose(grad[0, 0, 1, 2], fd, rtol=1e-2)
