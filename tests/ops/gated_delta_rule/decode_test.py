"""Decoding: T=1 calls carrying `initial_state` -> `final_state` reproduce the
full-sequence result token by token, for every registered implementation of
the gated delta rule and of causal_conv1d. Also prefill-then-decode, and states
handed from one implementation to another (one state layout for all)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d.api import causal_conv1d
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.testing import conformance as conf
from tokamax_gdn.testing.specs import rel_rms, tolerance

from . import test_base as h  # pylint: disable=relative-beyond-top-level


def _params(op_name):
  return [pytest.param(n, id=n) for n in registry.implementations(op_name)]


# ------------------------------------------------------------------ GDN
def _gdn_inputs(seed, *, b=2, t=12, hk=1, hv=2, dk=16, dv=8, dtype=jnp.float32):
  """Harness inputs with gate parameters and L2 norm: (positional args,
  initial state, keyword arguments)."""
  diff, _ = h.inputs(seed, b=b, t=t, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype, gate=True)
  args = tuple(diff[n] for n in h.POSITIONAL)
  kw = dict(a_log=diff["a_log"], dt_bias=diff["dt_bias"], use_qk_l2norm=True)
  return args, diff["initial_state"], kw


@functools.cache
def _gdn_jit(impl, use_qk_l2norm):
  return jax.jit(functools.partial(gated_delta_rule, use_qk_l2norm=use_qk_l2norm,
                                   output_final_state=True, implementation=impl))


def _gdn_call(impl, args, s0, kw):
  kw = dict(kw)
  fn = _gdn_jit(impl, kw.pop("use_qk_l2norm"))
  with h.context(impl):
    return fn(*args, initial_state=s0, **kw)


def _gdn_decode(impl, args, s0, kw, start=0):
  """Token-by-token from `start`, carrying the state: (outs [B,T-start,..], state)."""
  step = functools.partial(_gdn_call, impl)
  outs, s = [], s0
  for t in range(start, args[0].shape[1]):
    out, s = step(tuple(x[:, t:t + 1] for x in args), s, kw)
    assert out.shape[1] == 1 and s.dtype == jnp.float32
    outs.append(out)
  return jnp.concatenate(outs, axis=1), s


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", _params("gated_delta_rule"))
def test_gdn_token_by_token_equals_full_sequence(impl, dtype):
  args, s0, kw = _gdn_inputs(0, dtype=dtype)
  full_out, full_state = _gdn_call(impl, args, s0, kw)
  dec_out, dec_state = _gdn_decode(impl, args, s0, kw)
  tol = tolerance(dtype, grad=False)
  assert rel_rms(dec_out, full_out) <= tol, rel_rms(dec_out, full_out)
  assert rel_rms(dec_state, full_state) <= tol, rel_rms(dec_state, full_state)
  # And both against the reference's full sequence.
  ref_out, ref_state = _gdn_call("reference", args, s0, kw)
  assert rel_rms(dec_out, ref_out) <= tol
  assert rel_rms(dec_state, ref_state) <= tol


@pytest.mark.parametrize("decode_impl", _params("gated_delta_rule"))
@pytest.mark.parametrize("prefill_impl", _params("gated_delta_rule"))
def test_gdn_prefill_then_decode_across_implementations(prefill_impl, decode_impl):
  """Prefill 9 tokens with one implementation, decode 3 with another."""
  args, s0, kw = _gdn_inputs(1, b=1, t=12, hk=2, hv=4, dk=8, dv=16)
  full_out, full_state = _gdn_call("reference", args, s0, kw)
  pre_out, pre_state = _gdn_call(prefill_impl, tuple(x[:, :9] for x in args), s0, kw)
  tol = tolerance(jnp.float32, grad=False)
  assert rel_rms(pre_out, full_out[:, :9]) <= tol
  dec_out, dec_state = _gdn_decode(decode_impl, args, pre_state, kw, start=9)
  assert rel_rms(dec_out, full_out[:, 9:]) <= tol
  assert rel_rms(dec_state, full_state) <= tol


@pytest.mark.parametrize("impl", _params("gated_delta_rule"))
def test_gdn_decode_gradients_through_carried_state(impl):
  """d/d(initial_state) through two T=1 steps equals the full-sequence one."""
  args, s0, kw = _gdn_inputs(2, b=1, t=2, hk=1, hv=1, dk=8, dv=8)
  cot = jnp.asarray(np.random.default_rng(3).standard_normal((1, 2, 1, 8)), jnp.float32)

  def full(s0):
    out, fin = gated_delta_rule(*args, initial_state=s0, output_final_state=True,
                                implementation=impl, **kw)
    return jnp.sum(out * cot) + jnp.sum(fin)

  def stepped(s0):
    o1, s1 = gated_delta_rule(*(x[:, :1] for x in args), initial_state=s0,
                              output_final_state=True, implementation=impl, **kw)
    o2, s2 = gated_delta_rule(*(x[:, 1:] for x in args), initial_state=s1,
                              output_final_state=True, implementation=impl, **kw)
    return jnp.sum(jnp.concatenate([o1, o2], axis=1) * cot) + jnp.sum(s2)

  with h.context(impl):
    g_full = jax.jit(jax.grad(full))(s0)
    g_step = jax.jit(jax.grad(stepped))(s0)
  assert rel_rms(g_step, g_full) <= tolerance(jnp.float32, grad=True)


# ------------------------------------------------------------- causal_conv1d
def _conv_inputs(seed, *, b=2, t=10, d=6, w=4, dtype=jnp.float32):
  r = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(r.standard_normal(s), dtype)
  return normal(b, t, d), normal(d, w), normal(d), normal(b, w - 1, d)


@functools.cache
def _conv_jit(impl):
  return jax.jit(functools.partial(causal_conv1d, output_final_state=True,
                                   implementation=impl))


def _conv_call(impl, x, weight, bias, state):
  with conf.execution_context(impl):
    return _conv_jit(impl)(x, weight, bias, initial_state=state)


@pytest.mark.parametrize("piece", [1, 2, 3], ids=["T1", "T2_lt_W-1", "T3"])
@pytest.mark.parametrize("impl", _params("causal_conv1d"))
def test_conv_piecewise_equals_full_sequence(impl, piece):
  x, weight, bias, s0 = _conv_inputs(4, t=12)
  full_y, full_state = _conv_call(impl, x, weight, bias, s0)
  ys, s = [], s0
  for t in range(0, x.shape[1], piece):
    y, s = _conv_call(impl, x[:, t:t + piece], weight, bias, s)
    assert s.shape == s0.shape
    ys.append(y)
  dec_y = jnp.concatenate(ys, axis=1)
  tol = tolerance(jnp.float32, grad=False)
  assert rel_rms(dec_y, full_y) <= tol
  np.testing.assert_array_equal(np.asarray(s), np.asarray(full_state))
  ref_y, _ = _conv_call("reference", x, weight, bias, s0)
  assert rel_rms(dec_y, ref_y) <= tol


@pytest.mark.parametrize("impl", _params("causal_conv1d"))
def test_conv_decode_bf16_state_is_exact_copy_of_inputs(impl):
  """The conv state holds raw inputs: decoding in bf16 matches the full call."""
  x, weight, bias, s0 = _conv_inputs(5, t=6, dtype=jnp.bfloat16)
  full_y, full_state = _conv_call(impl, x, weight, bias, s0)
  ys, s = [], s0
  for t in range(x.shape[1]):
    y, s = _conv_call(impl, x[:, t:t + 1], weight, bias, s)
    ys.append(y)
  np.testing.assert_array_equal(np.asarray(s, np.float32), np.asarray(full_state, np.float32))
  np.testing.assert_array_equal(np.asarray(s[:, -1], np.float32),
                                np.asarray(x[:, -1], np.float32))
  assert rel_rms(jnp.concatenate(ys, axis=1), full_y) <= tolerance(jnp.bfloat16, grad=False)


# ------------------------------------------------------------- empty chunks
@pytest.mark.parametrize("impl", _params("gated_delta_rule"))
def test_gdn_zero_tokens_passes_state_through(impl):
  """T=0 (an empty prefill or decode step): empty output, state unchanged."""
  args, s0, kw = _gdn_inputs(6, b=1, t=0, hk=1, hv=2, dk=8, dv=8)
  out, state = _gdn_call(impl, args, s0, kw)
  assert out.shape == (1, 0, 2, 8)
  np.testing.assert_array_equal(np.asarray(state), np.asarray(s0))


@pytest.mark.parametrize("impl", _params("causal_conv1d"))
def test_conv_zero_tokens_passes_state_through(impl):
  x, weight, bias, s0 = _conv_inputs(7, t=0)
  y, state = _conv_call(impl, x, weight, bias, s0)
  assert y.shape == (2, 0, 6)
  np.testing.assert_array_equal(np.asarray(state), np.asarray(s0))
