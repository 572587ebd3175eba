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

The tier is compile-bound (XLA's and Mosaic's compilers on the host): on a
chip the tests' bodies run side by side in threads ahead of pytest's order
(`tests/tpu/ahead.py`, `_run_ahead`), within a budget of device memory, and
draw their inputs on the host (numpy, or `tokamax_gdn.testing.draws`): no
program for the chip is compiled to draw random numbers.
"""

import collections
import functools
import os
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn as tg
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs as serving_specs
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu as gdn_pallas
from tokamax_gdn.ops.gmm import arg_specs as gmm_specs
from tokamax_gdn.testing import draws
from tokamax_gdn.testing import specs as specs_lib
from tests import conformance_test
from tests import once
from tests.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu_test as serving_pallas
from tests.ops.causal_conv1d_gated_delta_rule import test_base as serving_base
from tests.tpu import ahead
from tests.tpu import oracles

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
  assert specs_lib.all_finite(actual), f"{what}: non-finite values"
  assert err <= tol, f"{what}: rel-RMS {err:.3g} > {tol:.3g}"


def _host(tree):
  return jax.tree.map(np.asarray, tree)


def _normal(rng, shape, dtype=np.float32, scale=None):
  """Unit-normal draws on the host (numpy): on the chip a jax.random draw of
  a new shape is a compile, 17 s for one at T = 32768."""
  x = rng.standard_normal(shape, np.float32)
  if scale is not None:
    x *= scale
  return x.astype(dtype)


def _gdn_inputs(t: int):
  rng = np.random.default_rng(t)
  bf = jnp.bfloat16
  q = _normal(rng, (1, t, _HK, _D), bf)
  k = _normal(rng, (1, t, _HK, _D), bf)
  v = _normal(rng, (1, t, _HV, _D), bf)
  gate = _normal(rng, (1, t, _HV), bf)                   # raw gate: a_log, dt_bias inside
  beta = _normal(rng, (1, t, _HV), bf)                   # logits: sigmoid inside
  a_log = np.log(rng.uniform(1.0, 16.0, (_HV,))).astype(np.float32)
  dt_bias = _normal(rng, (_HV,), scale=0.5)
  ct = _normal(rng, (1, t, _HV, _D))
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
  """fn's output and the gradients of <output, ct>, on the host."""
  # The cotangent goes in as an argument: closed over, it would be a constant
  # of T x width floats in the program, and at T = 32768 compiling the conv
  # layer's step around that constant took 78 s on the chip (the test timed out).
  def loss(ct, *a):
    out = fn(*a)
    return jnp.sum(out.astype(jnp.float32) * ct), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(1, len(args) + 1)),
                                               has_aux=True))(ct, *args)
  return _host((out, grads))


class _Shared:
  """Inputs and `reference` results that several tests check against,
  computed once (`tests.once`: the first test to want them, the others wait)
  and dropped once the last of the tests selected that use them is done."""

  def __init__(self):
    self._once = once.Once()
    self._left = collections.Counter()
    self._lock = threading.Lock()

  def expect(self, keys) -> None:
    """The keys the selected tests will use, one per use."""
    with self._lock:
      self._left = collections.Counter(keys)

  def get(self, key, compute):
    return self._once.get(key, compute)

  def done(self, key, forget=None) -> None:
    """A test is done with `key` (after the last: `forget()`, or the result dropped)."""
    with self._lock:
      if self._left[key] <= 0:
        return
      self._left[key] -= 1
      last = self._left[key] == 0
    if last:
      (forget or (lambda: self._once.forget(key)))()


_SHARED = _Shared()


def _gdn_case(t, dtype):
  """The layer's inputs at T = `t` in `dtype` (bf16 as drawn; float32 the
  same values widened) and `reference`'s results on them."""
  def compute():
    args, ct = _gdn_inputs(t)
    if dtype == jnp.float32:
      args = tuple(x.astype(np.float32) for x in args)
    return args, ct, _loss_and_grads(_chained_reference, args, ct)
  return _SHARED.get(("gdn", t, jnp.dtype(dtype).name), compute)


# float32 at T = 4096: its VMEM needs more per value head than bf16's (the
# step did not compile for any generation until the model counted it).
@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("t,dtype", [(4096, jnp.bfloat16), (32768, jnp.bfloat16),
                                     (4096, jnp.float32)], ids=["4096", "32768", "4096-f32"])
def test_gdn_layer_forward_and_gradients(impl, t, dtype):
  try:
    args, ct, (ref_out, ref_grads) = _gdn_case(t, dtype)
    out, grads = _loss_and_grads(lambda *a: _gdn_layer(impl, *a)[0], args, ct)
  finally:
    _SHARED.done(("gdn", t, jnp.dtype(dtype).name))
  _assert_close(out, ref_out, dtype, False, f"{impl} T={t} out")
  for name, g, r in zip(("q", "k", "v", "gate", "beta", "a_log", "dt_bias"), grads, ref_grads):
    _assert_close(g, r, dtype, True, f"{impl} T={t} d{name}")


def _conv_run(impl, x, w, bias, ct):
  return _loss_and_grads(
      lambda *a: tg.causal_conv1d(*a, activation="silu", implementation=impl)[0], (x, w, bias), ct)


def _conv_case(t):
  """The conv layer's inputs at T = `t` and `reference`'s results on them."""
  def compute():
    dim = 2 * _HK * _D + _HV * _D
    rng = np.random.default_rng(t + 1)
    x = _normal(rng, (1, t, dim), jnp.bfloat16)
    w = _normal(rng, (dim, 4), jnp.bfloat16, scale=0.5)
    bias = _normal(rng, (dim,), jnp.bfloat16, scale=0.1)
    ct = _normal(rng, (1, t, dim))
    return (x, w, bias, ct), _conv_run("reference", x, w, bias, ct)
  return _SHARED.get(("conv", t), compute)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("t", [4096, 32768])
def test_conv_layer_forward_and_gradients(impl, t):
  try:
    inputs, (ref_out, ref_grads) = _conv_case(t)
    out, grads = _conv_run(impl, *inputs)
  finally:
    _SHARED.done(("conv", t))
  _assert_close(out, ref_out, jnp.bfloat16, False, f"{impl} T={t} out")
  for name, g, r in zip(("x", "weight", "bias"), grads, ref_grads):
    _assert_close(g, r, jnp.bfloat16, True, f"{impl} T={t} d{name}")


# --- Serving --------------------------------------------------------------------------------

_NAMED = [s.name for s in serving_specs.ARG_SPECS if "tokamax" in s.tags]


class _ServingOnChip(serving_base.ServingTestBase):
  """The serving op's shared tests (tests/ops/causal_conv1d_gated_delta_rule/
  test_base.py) on the chip, plus every named workload."""

  @pytest.mark.parametrize("name", _NAMED)
  def test_named_workload(self, name):
    lay = serving_specs.layout_of(name)
    try:
      self._check_against_ours_and_tokamax(name, lay)
    finally:
      _SHARED.done(("named", name), lambda: serving_base.forget(name))


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


_PADDED_DIMS = dict(n_kq=2, n_v=8, d_k=128, d_v=128)    # TP8's heads
_PADDED_LOWERED = {}


def _padded_programs(mode):
  return serving_pallas.padded_batch_programs(mode, dims=_PADDED_DIMS, interpret=False)


@pytest.mark.parametrize("mode", serving_pallas.SKIP_MODES)
def test_padded_batch_skips_idle_requests_bit_for_bit(mode):
  """The decode kernel's idle tiles and groups skipped, compiled for the
  chip at TP8's heads: bit-identical to computing them, and the reference's
  results (`serving_pallas.check_padded_batch_skips_idle`)."""
  # Lowered before the tests started running side by side (`_run_ahead`):
  # the lowering switches module flags that another test's trace would read.
  programs = _PADDED_LOWERED.pop(mode, None) or _padded_programs(mode)
  if isinstance(programs, BaseException):
    raise programs
  serving_pallas.check_padded_batch_skips_idle(programs)


class TestServingXlaOnChip(_ServingOnChip):
  IMPL = "xla"


# --- Grouped matmuls ------------------------------------------------------------------------

def _gmm_case(m, k, n):
  """Inputs and `reference`'s results of one MoE shape (drawn on the host),
  computed once for both implementations."""
  def compute():
    g = 64
    rng = np.random.default_rng(m + k)
    sizes = draws.draw(
        lambda key: gmm_specs.random_group_sizes(key, g=g, total=m, empty=(2, 40)), m + k)
    lhs = _normal(rng, (m, k), jnp.bfloat16)
    rhs = _normal(rng, (g, k, n), jnp.bfloat16, scale=k ** -0.5)
    ct = _normal(rng, (m, n))
    y = _normal(rng, (m, n), jnp.bfloat16)
    inputs = (np.asarray(sizes), lhs, rhs, ct, y)
    return inputs, _gmm_run("reference", *inputs)
  return _SHARED.get(("gmm", m, k, n), compute)


def _gmm_run(impl, sizes, lhs, rhs, ct, y):
  """gmm's output and gradients, and tgmm's output, on the host."""
  out, grads = _loss_and_grads(
      lambda a, b: tg.gmm(a, b, sizes, implementation=impl), (lhs, rhs), ct)
  tg_out = jax.jit(functools.partial(tg.tgmm, implementation=impl))(lhs, y, sizes)
  return out, grads, np.asarray(tg_out)


@pytest.mark.parametrize("impl", FAST)
@pytest.mark.parametrize("m,k,n", [(8192, 2048, 512), (8192, 512, 2048)])
def test_gmm_tgmm_moe_shapes(impl, m, k, n):
  try:
    inputs, (ref_out, ref_grads, tg_ref) = _gmm_case(m, k, n)
    out, grads, tg_out = _gmm_run(impl, *inputs)
  finally:
    _SHARED.done(("gmm", m, k, n))
  _assert_close(out, ref_out, jnp.bfloat16, False, f"gmm {impl} out")
  for name, gr, r in zip(("lhs", "rhs"), grads, ref_grads):
    _assert_close(gr, r, jnp.bfloat16, True, f"gmm {impl} d{name}")
  # The empty groups' weight gradients are exactly zero.
  np.testing.assert_array_equal(np.asarray(grads[1][2], np.float32), 0.0)
  _assert_close(tg_out, tg_ref, jnp.bfloat16, False, f"tgmm {impl}")


# --- VMEM overflow --------------------------------------------------------------------------

def test_config_past_vmem_raises_then_next_call_works():
  args, _ = _gdn_inputs(1024)
  args = jax.device_put([x.astype(np.float32) for x in args])
  q, k, v, gate, beta, a_log, dt_bias = args
  big = tg.registry.get("gated_delta_rule", "pallas_mosaic_tpu").replace(
      config=gdn_pallas.Config(chunk_size=256, interleave=32))
  with pytest.raises(ValueError, match="MiB of VMEM"):
    _gdn_layer(big, q, k, v, gate, beta, a_log, dt_bias)
  out, _ = jax.jit(lambda *a: _gdn_layer("pallas_mosaic_tpu", *a))(*args)
  ref, _ = jax.jit(lambda *a: _gdn_layer("xla", *a))(*args)
  _assert_close(out, ref, jnp.float32, False, "after the refused config")


# --- Running the tests side by side ---------------------------------------------------------

_GIB = 1 << 30
# Of the chip's 15.7 GiB, what the tests running side by side may hold
# (`Plan.device_bytes`, estimates from their arrays; the rest is headroom).
_DEVICE_BYTES_CAP = 12 * _GIB


def _shared_key(item):
  """The `_SHARED` key a test uses, or None."""
  params = getattr(getattr(item, "callspec", None), "params", {})
  name = item.originalname
  if name == "test_gdn_layer_forward_and_gradients":
    return ("gdn", params["t"], jnp.dtype(params["dtype"]).name)
  if name == "test_conv_layer_forward_and_gradients":
    return ("conv", params["t"])
  if name == "test_gmm_tgmm_moe_shapes":
    return ("gmm", params["m"], params["k"], params["n"])
  if name == "test_named_workload":
    return ("named", params["name"])
  return None


def _layout_bytes(name) -> int:
  lay = serving_specs.layout_of(name)
  return sum(x.size * jnp.dtype(x.dtype).itemsize for x in lay.values()
             if isinstance(x, jax.ShapeDtypeStruct))


def _plan(item) -> ahead.Plan:
  """How a test runs ahead (`tests/tpu/ahead.py`): the device bytes it may
  hold (inputs, reference results and the implementation's, about four
  times the inputs), the long ones first, and the serving op's tests after
  the padded batches' programs are lowered (`_run_ahead`)."""
  params = getattr(getattr(item, "callspec", None), "params", {})
  name = item.originalname
  serving = (isinstance(item.cls, type) and issubclass(item.cls, _ServingOnChip)) or name in (
      "test_serving_lane_specs", "test_padded_batch_skips_idle_requests_bit_for_bit") or (
          name == "test_conformance_spec" and params["case"][0] == "causal_conv1d_gated_delta_rule")
  small = _GIB // 4
  # At T = 32768 one layer test at a time (and the second waits for its
  # memory, not for the reference the first computes).
  if name == "test_gdn_layer_forward_and_gradients":
    return ahead.Plan((8 * _GIB if params["t"] > 4096 else 2 * _GIB), early=True)
  if name == "test_conv_layer_forward_and_gradients":
    return ahead.Plan((6 * _GIB if params["t"] > 4096 else _GIB), early=True)
  if name == "test_gmm_tgmm_moe_shapes":
    return ahead.Plan(_GIB, early=True)
  if name == "test_named_workload":
    return ahead.Plan(max(small, 4 * _layout_bytes(params["name"])), gated=True)
  return ahead.Plan(small, gated=serving)


# Child processes computing the named workloads' oracles on the host's CPU
# (tests/tpu/oracles.py); 0: computed on the chip, in the tests.
_ORACLE_PROCESSES_ENV = "TOKAMAX_GDN_TIER_ORACLE_PROCESSES"


@pytest.fixture(scope="module", autouse=True)
def _run_ahead(request):
  """Runs the selected tests' bodies side by side in threads (`tests/tpu/
  ahead.py`; `$TOKAMAX_GDN_TIER_AHEAD`: 0 turns it off, N sets the threads),
  after lowering the padded batches' programs, whose module switches the
  serving op's other tests must not see while they trace; the named
  workloads' oracles come from child processes (`tests/tpu/oracles.py`)."""
  items = [item for item in request.session.items
           if getattr(item, "module", None) is request.module]
  _SHARED.expect(k for k in map(_shared_key, items) if k is not None)
  workers = ahead.workers_from_env()
  if not workers or jax.devices()[0].platform != "tpu":
    yield
    return
  named = list(dict.fromkeys(item.callspec.params["name"] for item in items
                             if item.originalname == "test_named_workload"))
  children = oracles.Children(named, int(os.environ.get(_ORACLE_PROCESSES_ENV, "2")))
  serving_base.set_oracle_source(children.take)
  ahead.start(items, _plan, workers=workers, device_bytes_cap=_DEVICE_BYTES_CAP)
  try:
    for item in items:
      if item.originalname == "test_padded_batch_skips_idle_requests_bit_for_bit":
        mode = item.callspec.params["mode"]
        try:
          _PADDED_LOWERED[mode] = _padded_programs(mode)
        except Exception as e:  # pylint: disable=broad-exception-caught
          _PADDED_LOWERED[mode] = e      # the test raises it
    ahead.open_gate()
    yield
  finally:
    ahead.stop()
    serving_base.set_oracle_source(None)
    children.close()
