"""Stress tests for the gated delta rule: long sequences, extreme gates and betas,
zero keys under L2 normalisation, bf16, and state growth without decay.

Every registered implementation other than `reference` is exercised; the Pallas
kernel runs in interpret mode on CPU only for the small shapes (interpret mode
is far too slow for thousands of tokens, those run on a TPU).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.testing.specs import rel_rms, tolerance

from . import test_base as h  # pylint: disable=relative-beyond-top-level

OP = "gated_delta_rule"
INTERPRET_MAX_T = 4096
DIFF_NAMES = ("query", "key", "value", "g", "beta", "initial_state")


def _impls(t: int, include_reference: bool = False):
  """Registered implementations that can run T tokens here, as pytest params."""
  out = []
  for name in registry.implementations(OP):
    if name == "reference" and not include_reference:
      continue
    marks = ()
    if name == "pallas_mosaic_tpu" and not config.on_tpu() and t > INTERPRET_MAX_T:
      marks = pytest.mark.skip(
          reason=f"Pallas interpret mode on CPU is too slow for T={t}; runs on a TPU")
    out.append(pytest.param(name, marks=marks, id=name))
  return out


def _inputs(seed, *, b=1, t=64, hk=1, hv=2, dk=16, dv=16, dtype=jnp.float32,
            unit_keys=True, state=True):
  """Harness inputs: (diff arrays by name, static keyword arguments)."""
  return h.inputs(seed, b=b, t=t, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype,
                  unit_keys=unit_keys, initial_state=state)


def fwd_bwd(impl, args, kw, *, seed=5):
  """(out, final_state, grads) of a random linear loss, under jit."""
  return h.fwd_bwd(impl, args, kw, seed=seed)


_assert_finite = h.assert_finite


def _assert_match(got, want, dtype, what):
  h.assert_close(got, want, dtype, what)


# ---------------------------------------------------------------- long T
def _long_cases():
  """T=32768 where it runs in reasonable time here; Pallas in interpret mode
  at T=4096 and K=V=8 (its T=32768 compile is in tests/aot_test.py)."""
  slow = lambda name: name == "pallas_mosaic_tpu" and not config.on_tpu()
  return [pytest.param(name, 4096 if slow(name) else 32768, 8 if slow(name) else 16, id=name)
          for name in registry.implementations(OP) if name != "reference"]


@pytest.mark.parametrize("impl,t,dim", _long_cases())
def test_long_t_gates_alternating_0_and_minus80(impl, t, dim):
  args, kw = _inputs(0, t=t, hk=1, hv=1, dk=dim, dv=dim, state=False)
  g = jnp.where(jnp.arange(t) % 2 == 0, 0.0, -80.0).astype(jnp.float32)
  args["g"] = jnp.broadcast_to(g[None, :, None], (1, t, 1))
  out, fin, grads = fwd_bwd(impl, args, kw)
  _assert_finite((out, fin, grads), f"{impl} T={t}")
  # A -80 gate wipes the state (exp(-80) ~ 2e-35), so the last tokens only
  # depend on themselves: compare them with the reference on a short window
  # starting at a -80 gate.
  w = 63
  assert t % 2 == 0 and (t - w) % 2 == 1
  tail = {n: x[:, t - w:] for n, x in args.items()}
  r_out, r_fin = gated_delta_rule(*[tail[n] for n in DIFF_NAMES[:5]],
                                  output_final_state=True, implementation="reference")
  assert rel_rms(out[:, t - w:], r_out) <= tolerance(jnp.float32, grad=False)
  assert rel_rms(fin, r_fin) <= tolerance(jnp.float32, grad=False)
  # Gradients of tokens that a later -80 gate erased from the final state:
  # only the output cotangent reaches them, so they stay O(1).
  assert float(jnp.abs(grads["value"]).max()) < 1e3


@pytest.mark.parametrize("impl", _impls(4096))
def test_long_sequence_no_decay_matches_reference_and_stays_bounded(impl):
  """g = 0 (no forgetting), unit keys, beta in (0, 1]: |beta k^T k| <= 1.

  Along the key direction the state column becomes a convex combination of its
  old value and v, and is left unchanged across it: the state stays of the
  size of the values, for any T. Errors must not accumulate either.
  """
  t, dk, dv = 4096, 16, 16
  args, kw = _inputs(1, t=t, hk=1, hv=1, dk=dk, dv=dv, state=False)
  args["g"] = jnp.zeros_like(args["g"])
  args["beta"] = jnp.asarray(np.random.default_rng(2).uniform(1e-3, 1.0, (1, t, 1)),
                             jnp.float32)
  with h.context(impl):
    out, fin = jax.jit(functools.partial(gated_delta_rule, output_final_state=True,
                                         implementation=impl))(
        *[args[n] for n in DIFF_NAMES[:5]])
  _assert_finite((out, fin), impl)
  v_max = float(jnp.abs(args["value"]).max())
  col_norms = jnp.linalg.norm(fin[0, 0], axis=0)       # per value channel, over K
  assert float(col_norms.max()) <= np.sqrt(dk) * v_max, float(col_norms.max())
  q_norm = float(jnp.linalg.norm(args["query"], axis=-1).max())
  assert float(jnp.abs(out).max()) <= dk**-0.5 * q_norm * np.sqrt(dk) * v_max
  r_out, r_fin = jax.jit(functools.partial(gated_delta_rule, output_final_state=True,
                                           implementation="reference"))(
      *[args[n] for n in DIFF_NAMES[:5]])
  assert rel_rms(out, r_out) <= tolerance(jnp.float32, grad=False)
  assert rel_rms(fin, r_fin) <= tolerance(jnp.float32, grad=False)


@pytest.mark.parametrize("impl", _impls(200))
def test_repeated_key_beta1_no_decay_is_exact(impl):
  """Same unit key every token, beta = 1, g = 0: S_t = S_0 (I - kk^T) + k v_t^T
  exactly, the hardest case for the in-chunk inverse (A = all-ones lower)."""
  t, dk, dv = 200, 16, 8
  args, kw = _inputs(3, t=t, hk=1, hv=1, dk=dk, dv=dv)
  k = args["key"][0, 0, 0]
  args["key"] = jnp.broadcast_to(k, args["key"].shape)
  args["g"] = jnp.zeros_like(args["g"])
  args["beta"] = jnp.ones_like(args["beta"])
  out, fin, grads = fwd_bwd(impl, args, kw)
  _assert_finite((out, fin, grads), impl)
  s0 = args["initial_state"][0, 0]
  perp = s0 - jnp.outer(k, k @ s0)
  v = args["value"][0, :, 0]                                # [T, V]
  states = perp[None] + k[None, :, None] * v[:, None, :]    # [T, K, V]
  want = dk**-0.5 * jnp.einsum("tkv,tk->tv", states, args["query"][0, :, 0])
  assert rel_rms(out[0, :, 0], want) <= tolerance(jnp.float32, grad=False)
  assert rel_rms(fin[0, 0], states[-1]) <= tolerance(jnp.float32, grad=False)


@pytest.mark.parametrize("impl", _impls(128))
def test_correlated_keys_slow_decay(impl):
  """Realistic hard case for the in-chunk inverse (I + A)^-1, A = tril(beta KK^T Gamma):
  keys of one head correlated (cosine ~0.8, as for repeated or similar tokens),
  beta in [0.5, 1], slow decay g = -0.01. The exact inverse is well
  conditioned here; a Neumann-series inverse is not (powers of A grow like
  binomial coefficients before cancelling)."""
  t, dk, dv = 128, 16, 16
  args, kw = _inputs(7, t=t, hk=1, hv=1, dk=dk, dv=dv)
  r = np.random.default_rng(8)
  base = r.standard_normal(dk)
  base /= np.linalg.norm(base)
  k = 0.8 * base + 0.6 * r.standard_normal((1, t, 1, dk)) / np.sqrt(dk)
  args["key"] = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
  args["beta"] = jnp.asarray(r.uniform(0.5, 1.0, (1, t, 1)), jnp.float32)
  args["g"] = jnp.full_like(args["g"], -0.01)
  got = fwd_bwd(impl, args, kw)
  _assert_finite(got, impl)
  want = fwd_bwd("reference", args, kw)
  _assert_match(got, want, jnp.float32, f"{impl} correlated keys")


@pytest.mark.parametrize("big", [-80.0, -1e4], ids=["g-80", "g-1e4"])
@pytest.mark.parametrize("impl", _impls(128))
def test_sparse_very_negative_gates_keep_accuracy(impl, big):
  """Slow decay with 10% of tokens at a very negative gate (a forget), as
  -exp(a_log) * softplus(raw + dt_bias) gives for a large raw gate. A chunked
  cumsum of the gate then holds large values whose differences cancel: the
  small decays after a forget must not be lost to rounding."""
  t = 128
  args, kw = _inputs(9, t=t, hk=1, hv=1, dk=16, dv=16)
  r = np.random.default_rng(10)
  small = -np.logaddexp(0, r.standard_normal((1, t, 1))) * 0.05
  args["g"] = jnp.asarray(np.where(r.uniform(size=(1, t, 1)) < 0.1, big, small), jnp.float32)
  args["beta"] = jnp.asarray(r.uniform(0.0, 1.0, (1, t, 1)), jnp.float32)
  got = fwd_bwd(impl, args, kw)
  _assert_finite(got, impl)
  want = fwd_bwd("reference", args, kw)
  _assert_match(got, want, jnp.float32, f"{impl} sparse g={big}")


# ---------------------------------------------------------------- beta 0 / 1
@pytest.mark.parametrize("beta_kind", ["zero", "one", "mixed_0_1"])
@pytest.mark.parametrize("impl", _impls(80))
def test_beta_exactly_0_and_1(impl, beta_kind):
  args, kw = _inputs(4, t=80, hk=1, hv=2, dk=16, dv=8)
  b = {"zero": jnp.zeros_like(args["beta"]), "one": jnp.ones_like(args["beta"]),
       "mixed_0_1": (jnp.arange(80) % 3 == 0).astype(jnp.float32)[None, :, None]
                    * jnp.ones_like(args["beta"])}[beta_kind]
  args["beta"] = b
  got = fwd_bwd(impl, args, kw)
  _assert_finite(got, impl)
  want = fwd_bwd("reference", args, kw)
  _assert_match(got, want, jnp.float32, f"{impl} beta={beta_kind}")
  if beta_kind == "zero":
    # No writes: the state only decays.
    decay = jnp.exp(jnp.sum(args["g"][0], axis=0))          # [Hv]
    expected = decay[:, None, None] * args["initial_state"][0]
    np.testing.assert_allclose(got[1][0], expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- zero keys
@pytest.mark.parametrize("impl", _impls(48))
def test_zero_norm_keys_and_queries_with_l2norm(impl):
  """Keys/queries with norm exactly 0 hit the eps of the L2 norm: finite, and
  gradients equal to the reference's (the eps is the same in the backward)."""
  args, kw = _inputs(5, t=48, hk=2, hv=4, dk=16, dv=8, unit_keys=False)
  zero_t = jnp.array([0, 5, 6, 17, 31, 47])
  args["key"] = args["key"].at[:, zero_t].set(0.0)
  args["query"] = args["query"].at[:, zero_t[::2]].set(0.0)
  args["key"] = args["key"].at[:, 20, 1].set(0.0)        # one head only
  kw = dict(kw, use_qk_l2norm=True)
  got = fwd_bwd(impl, args, kw)
  _assert_finite(got, f"{impl} zero keys")
  want = fwd_bwd("reference", args, kw)
  _assert_finite(want, "reference zero keys")
  _assert_match(got, want, jnp.float32, f"{impl} zero keys")


# ---------------------------------------------------------------- bf16
@pytest.mark.parametrize("impl", _impls(192))
def test_bf16_against_float32_reference(impl):
  """bf16 inputs vs the float32 reference on the same (upcast) values: 2e-2."""
  args, kw = _inputs(6, t=192, hk=2, hv=4, dk=32, dv=32, dtype=jnp.bfloat16)
  kw = dict(kw, use_qk_l2norm=True)
  got = fwd_bwd(impl, args, kw)
  _assert_finite(got, f"{impl} bf16")
  assert got[0].dtype == jnp.bfloat16 and got[1].dtype == jnp.float32
  args32 = {n: x.astype(jnp.float32) for n, x in args.items()}
  want = fwd_bwd("reference", args32, kw)
  _assert_match(got, want, jnp.bfloat16, f"{impl} bf16 vs f32 reference")
