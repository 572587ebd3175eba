"""The on-chip tier: every registered implementation against `reference` on a
real TPU, compiled for the chip (no interpret mode).

Run on a TPU VM, in one process (the chip takes one holder):

    python -m pytest -m tpu -p no:xdist tests/tpu
    python -m tests.tpu.runner --out DIR     # a stall or crash contained, resumable

Without a TPU every test here skips (tests/conftest.py). What it covers:
- the conformance specs of every op (`tests/conformance_test.py`'s check);
- the Qwen3-Next / Qwen3.5 layer calls of `gated_delta_rule` (Hk 16, Hv 32,
  K = V = 128, bf16, gate and beta logits inside) and `causal_conv1d` (8192
  channels, width 4) at T = 4096 and 32768, forward and every gradient, the
  reference chained over token blocks (its token scan's autodiff would keep
  every state);
- every named serving workload in the serving op's `arg_specs.py` (tokamax's
  TP8 / DP / qwen3_5_35b / verify-window specs) against tokamax's oracle and
  ours, unused pool slots bit-identical, plus the serving op's property
  tests (NaN isolation, continuation, windows) on the chip, and batches
  padded with idle requests bit-identical with the decode kernel's idle
  tiles skipped and computed;
- gmm / tgmm at MoE shapes with empty groups, forward and gradients;
- a config forced past the chip's VMEM: a clear error before any compile,
  and the next call in the process works.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn as tg
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs as serving_specs
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu as gdn_pallas
from tokamax_gdn.ops.gmm import arg_specs as gmm_specs
from tokamax_gdn.testing import specs as specs_lib
from tests import conformance_test
from tests.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu_test as serving_pallas
from tests.ops.causal_conv1d_gated_delta_rule import test_base as serving_base
from tests.tpu import progress as tier_progress

pytestmark = pytest.mark.tpu

FAST = ("pallas_mosaic_tpu", "xla")


# --- Conformance specs ---------------------------------------------------------------------

# Every spec runs: the serving op's CPU-scaled ones (heads of 16 and 32) run
# its Pallas kernels padded to 128 lanes on the chip, where they used to be
# declined (and skipped here).
@pytest.mark.parametrize("case", conformance_test.AGAINST_REFERENCE, ids=conformance_test._id)  # pylint: disable=protected-access
def test_conformance_spec(case):
  conformance_test.test_forward_and_vjp_match_reference(case)


_LANE_SERVING = [("causal_conv1d_gated_delta_rule", impl, s) for s in serving_specs.ARG_SPECS
                 if s.name.startswith("dk128") for impl in FAST]


@pytest.mark.parametrize("case", _LANE_SERVING, ids=conformance_test._id)  # pylint: disable=protected-access
def test_serving_lane_specs(case):
  """The serving op's odd layouts at K = V = 128 (mixed, windows, bf16 pool)."""
  conformance_test.test_forward_and_vjp_match_reference(case)


# --- Layer shapes ---------------------------------------------------------------------------

_HK, _HV, _D = 16, 32, 128       # Qwen3-Next / Qwen3.5 GDN heads
_REF_BLOCK = 512                 # tokens per checkpointed reference block


def _assert_close(actual, expected, dtype, grad, what):
  err = specs_lib.rel_rms(actual, expected)
  tol = specs_lib.tolerance(dtype, grad=grad)
  assert np.isfinite(np.asarray(actual, np.float32)).all(), f"{what}: non-finite values"
  assert err <= tol, f"{what}: rel-RMS {err:.3g} > {tol:.3g}"


def _gdn_inputs(t: int):
  ks = jax.random.split(jax.random.key(t), 9)
  bf = jnp.bfloat16
  q = jax.random.normal(ks[0], (1, t, _HK, _D), bf)
  k = jax.random.normal(ks[1], (1, t, _HK, _D), bf)
  v = jax.random.normal(ks[2], (1, t, _HV, _D), bf)
  gate = jax.random.normal(ks[3], (1, t, _HV), bf)          # raw gate: a_log, dt_bias inside
  beta = jax.random.normal(ks[4], (1, t, _HV), bf)          # logits: sigmoid inside
  a_log = jnp.log(jax.random.uniform(ks[5], (_HV,), jnp.float32, 1.0, 16.0))
  dt_bias = jax.random.normal(ks[6], (_HV,), jnp.float32) * 0.5
  ct = jax.random.normal(ks[7], (1, t, _HV, _D), jnp.float32)
  return (q, k, v, gate, beta, a_log, dt_bias), ct


def _gdn_layer(impl, q, k, v, gate, beta, a_log, dt_bias, initial_state=None):
  return tg.gated_delta_rule(q, k, v, gate, beta, use_qk_l2norm=True, use_beta_sigmoid=True,
                             a_log=a_log, dt_bias=dt_bias, initial_state=initial_state,
                             output_final_state=initial_state is not None,
                             implementation=impl)


def _chained_reference(q, k, v, gate, beta, a_log, dt_bias):
  """`reference` over blocks of _REF_BLOCK tokens, the state carried between
  them, each block rematerialised in the backward: the same function, with
  memory for one block's token states instead of T's."""
  t = q.shape[1]
  n = t // _REF_BLOCK
  blocks = lambda x: jnp.moveaxis(x.reshape(x.shape[0], n, _REF_BLOCK, *x.shape[2:]), 1, 0)

  @jax.checkpoint
  def block(state, xs):
    out, state = _gdn_layer("reference", *xs, a_log, dt_bias, initial_state=state)
    return state, out

  state = jnp.zeros((q.shape[0], _HV, _D, _D), jnp.float32)
  _, outs = jax.lax.scan(block, state, tuple(blocks(x) for x in (q, k, v, gate, beta)))
  return jnp.moveaxis(outs, 0, 1).reshape(q.shape[0], t, _HV, _D)


def _loss_and_grads(fn, args, ct):
  # The cotangent goes in as an argument: closed over, it would be a constant
  # of T x width floats in the program, and at T = 32768 compiling the conv
  # layer's step around that constant took 78 s on the chip (the test timed out).
  def loss(ct, *a):
    out = fn(*a)
    return jnp.sum(out.astype(jnp.float32) * ct), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1, len(args) + 1)),
                                               has_aux=True))(ct, *args)
  return out, grads


_REF_CACHE = {}


def _gdn_case(t, dtype):
  """The layer's inputs at T = `t` in `dtype` (bf16 as drawn; float32 the
  same values widened) and `reference`'s results on them, cached for the
  implementations that follow."""
  args, ct = _gdn_inputs(t)
  if dtype == jnp.float32:
    args = tuple(x.astype(jnp.float32) for x in args)
  if (t, dtype) not in _REF_CACHE:
    _REF_CACHE.clear()
    _REF_CACHE[t, dtype] = _loss_and_grads(_chained_reference, args, ct)
  return args, ct, _REF_CACHE[t, dtype]


# impl varies fastest: the (slow) reference runs once per length and dtype.
# float32 at T = 4096: its VMEM needs more per value head than bf16's (the
# step did not compile for any generation until the model counted it).
@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("t,dtype", [(4096, jnp.bfloat16), (32768, jnp.bfloat16),
                                     (4096, jnp.float32)], ids=["4096", "32768", "4096-f32"])
def test_gdn_layer_forward_and_gradients(impl, t, dtype):
  args, ct, (ref_out, ref_grads) = _gdn_case(t, dtype)
  out, grads = _loss_and_grads(lambda *a: _gdn_layer(impl, *a)[0], args, ct)
  _assert_close(out, ref_out, dtype, False, f"{impl} T={t} out")
  for name, g, r in zip(("q", "k", "v", "gate", "beta", "a_log", "dt_bias"), grads, ref_grads):
    _assert_close(g, r, dtype, True, f"{impl} T={t} d{name}")


def _conv_run(impl, x, w, bias, ct):
  return _loss_and_grads(
      lambda *a: tg.causal_conv1d(*a, activation="silu", implementation=impl)[0], (x, w, bias), ct)


def _conv_case(t):
  """The conv layer's inputs at T = `t` and `reference`'s results on them,
  cached for the implementations that follow."""
  if ("conv", t) not in _REF_CACHE:
    dim = 2 * _HK * _D + _HV * _D
    ks = jax.random.split(jax.random.key(t + 1), 4)
    x = jax.random.normal(ks[0], (1, t, dim), jnp.bfloat16)
    w = (jax.random.normal(ks[1], (dim, 4), jnp.float32) * 0.5).astype(jnp.bfloat16)
    bias = (jax.random.normal(ks[2], (dim,), jnp.float32) * 0.1).astype(jnp.bfloat16)
    ct = jax.random.normal(ks[3], (1, t, dim), jnp.float32)
    _REF_CACHE.clear()
    _REF_CACHE["conv", t] = (x, w, bias, ct), _conv_run("reference", x, w, bias, ct)
  return _REF_CACHE["conv", t]


# impl varies fastest: the reference runs once per length.
@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("t", [4096, 32768])
def test_conv_layer_forward_and_gradients(impl, t):
  inputs, (ref_out, ref_grads) = _conv_case(t)
  out, grads = _conv_run(impl, *inputs)
  _assert_close(out, ref_out, jnp.bfloat16, False, f"{impl} T={t} out")
  for name, g, r in zip(("x", "weight", "bias"), grads, ref_grads):
    _assert_close(g, r, jnp.bfloat16, True, f"{impl} T={t} d{name}")


# --- Serving --------------------------------------------------------------------------------

_NAMED = [s.name for s in serving_specs.ARG_SPECS if "tokamax" in s.tags]


@pytest.fixture(scope="module", autouse=True)
def _oracles_ahead(request):
  """Computes the selected named workloads' oracles (tokamax's reference and
  ours) in threads, in test order, while the tests run the implementations,
  and then, in the same thread, calls the implementations the selected tests
  will check on that workload (their compiles): on the chip those compiles
  were nearly all of a named workload's time, and the chip host's cores sat
  idle. A test waits for its own oracle and implementation; an oracle's
  failure fails its tests, an implementation's is raised again by the
  test's own call. `progress.AHEAD_ENV`=0 turns it off."""
  warm = {}
  for item in request.session.items:
    if getattr(item, "originalname", "") == "test_named_workload":
      warm.setdefault(item.callspec.params["name"], []).append(item.cls.IMPL)
  workers = (0 if os.environ.get(tier_progress.AHEAD_ENV) == "0"
             else min(8, (os.cpu_count() or 1) - 2))
  if not warm or workers < 1 or jax.devices()[0].platform != "tpu":
    yield
    return
  pool = serving_base.compute_ahead([(n, serving_specs.layout_of(n)) for n in warm], workers,
                                    warm=warm, call=serving_base.ServingTestBase().call)
  yield
  serving_base.stop_ahead(pool)


class _ServingOnChip(serving_base.ServingTestBase):
  """The serving op's shared tests (tests/ops/causal_conv1d_gated_delta_rule/
  test_base.py) on the chip, plus every named workload."""

  @pytest.mark.parametrize("name", _NAMED)
  def test_named_workload(self, name):
    lay = serving_specs.layout_of(name)
    self._check_against_ours_and_tokamax(name, lay, *serving_base.tokamax_oracle(lay))


# The shared cases also at the kernels' own lane size (the CPU-scaled ones at
# 16 and 32 lanes, lifted to 128: the layouts real models serve, no padding).
_LANES = dict(n_kq=1, n_v=2, d_k=128, d_v=128)


def _lifted(cases):
  return [(f"{cid}_dk128", {**lay, "d_k": 128, "d_v": 128}) for cid, lay in cases]


_LIFTED_CASES = _lifted(serving_base.CASES)
_LIFTED_SPEC_CASES = _lifted(serving_base.SPEC_CASES)


class TestServingPallasOnChip(_ServingOnChip):
  IMPL = "pallas_mosaic_tpu"
  DIMS = _LANES

  @pytest.mark.parametrize("case_id,lay", _LIFTED_CASES, ids=[c[0] for c in _LIFTED_CASES])
  def test_against_tokamax_reference(self, case_id, lay):
    super().test_against_tokamax_reference(case_id, lay)

  @pytest.mark.parametrize("case_id,lay", _LIFTED_SPEC_CASES,
                           ids=[c[0] for c in _LIFTED_SPEC_CASES])
  def test_spec_windows_against_tokamax(self, case_id, lay):
    super().test_spec_windows_against_tokamax(case_id, lay)


@pytest.mark.parametrize("mode", serving_pallas.SKIP_MODES)
def test_padded_batch_skips_idle_requests_bit_for_bit(mode, monkeypatch):
  """The decode kernel's idle tiles and groups skipped, compiled for the
  chip at TP8's heads: bit-identical to computing them, and the reference's
  results (`serving_pallas.check_padded_batch_skips_idle`)."""
  serving_pallas.check_padded_batch_skips_idle(
      mode, monkeypatch, dims=dict(n_kq=2, n_v=8, d_k=128, d_v=128), interpret=False)


class TestServingXlaOnChip(_ServingOnChip):
  IMPL = "xla"


# --- Grouped matmuls ------------------------------------------------------------------------

_GMM_REF = {}


def _gmm_case(m, k, n):
  """Inputs and `reference`'s results of one MoE shape (drawn with numpy: on a
  chip every jax.random draw of a new shape is a compile), computed once for
  both implementations."""
  if (m, k, n) not in _GMM_REF:
    g = 64
    rng = np.random.default_rng(m + k)
    sizes = gmm_specs.random_group_sizes(jax.random.key(m + k), g=g, total=m, empty=(2, 40))
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n), np.float32) * k ** -0.5, jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((m, n), np.float32))
    y = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.bfloat16)
    ref = _gmm_run("reference", sizes, lhs, rhs, ct, y)
    _GMM_REF.clear()
    _GMM_REF[m, k, n] = (sizes, lhs, rhs, ct, y), ref
  return _GMM_REF[m, k, n]


def _gmm_run(impl, sizes, lhs, rhs, ct, y):
  """gmm's output and gradients, and tgmm's output, on the host."""
  out, grads = _loss_and_grads(
      lambda a, b: tg.gmm(a, b, sizes, implementation=impl), (lhs, rhs), ct)
  tg_out = jax.jit(functools.partial(tg.tgmm, implementation=impl))(lhs, y, sizes)
  return jax.tree.map(np.asarray, (out, grads, tg_out))


# impl varies fastest: the reference runs once per shape.
@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("m,k,n", [(8192, 2048, 512), (8192, 512, 2048)])
def test_gmm_tgmm_moe_shapes(impl, m, k, n):
  inputs, (ref_out, ref_grads, tg_ref) = _gmm_case(m, k, n)
  out, grads, tg_out = _gmm_run(impl, *inputs)
  _assert_close(out, ref_out, jnp.bfloat16, False, f"gmm {impl} out")
  for name, gr, r in zip(("lhs", "rhs"), grads, ref_grads):
    _assert_close(gr, r, jnp.bfloat16, True, f"gmm {impl} d{name}")
  # The empty groups' weight gradients are exactly zero.
  np.testing.assert_array_equal(np.asarray(grads[1][2], np.float32), 0.0)
  _assert_close(tg_out, tg_ref, jnp.bfloat16, False, f"tgmm {impl}")


# --- VMEM overflow --------------------------------------------------------------------------

def test_config_past_vmem_raises_then_next_call_works():
  args, _ = _gdn_inputs(1024)
  args = [x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in args]
  q, k, v, gate, beta, a_log, dt_bias = args
  big = tg.registry.get("gated_delta_rule", "pallas_mosaic_tpu").replace(
      config=gdn_pallas.Config(chunk_size=256, interleave=32))
  with pytest.raises(ValueError, match="MiB of VMEM"):
    _gdn_layer(big, q, k, v, gate, beta, a_log, dt_bias)
  out, _ = jax.jit(lambda *a: _gdn_layer("pallas_mosaic_tpu", *a))(*args)
  ref, _ = jax.jit(lambda *a: _gdn_layer("xla", *a))(*args)
  _assert_close(out, ref, jnp.float32, False, "after the refused config")
