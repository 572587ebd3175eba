"""pallas_mosaic_tpu gated delta rule vs the reference, in Pallas interpret mode.

Interpret mode runs the TPU kernels on CPU with the TPU's MXU rounding (the
kernels round their operands to bf16 themselves), so these tolerances hold
on the chip too. Shapes are tiny (interpret mode is slow); each case combines
several features. Compiling for real TPU generations is in tests/aot_test.py,
the kernel stages against the xla stages in pallas_mosaic_tpu_kernel_test.py.
"""

import dataclasses
import functools

import jax
from jax._src import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_call as pk_call
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as pk_common
from tokamax_gdn.testing import specs

Config = pallas_mosaic_tpu.Config


def _inputs(seed, *, b, t, hk, hv, dk, dv, dtype, gate_mode, raw_gate, init, segments,
            dt_bias=True):
  r = np.random.default_rng(seed)
  normal = lambda *s: r.standard_normal(s).astype(np.float32)
  q, k, v = normal(b, t, hk, dk), normal(b, t, hk, dk), normal(b, t, hv, dv)
  beta = 1.0 / (1.0 + np.exp(-normal(b, t, hv)))
  if raw_gate:
    g = normal(b, t, hv)
    if gate_mode == "floored":   # raw gates whose log-decay is below the -30 floor
      g = np.where(r.random(g.shape) < 0.2, 60.0, g)
  else:
    g = -np.logaddexp(0.0, normal(b, t, hv) - 1.0)
    if gate_mode == "zeros":
      g = np.where(r.random(g.shape) < 0.5, 0.0, g)
    elif gate_mode == "minus80":
      g = np.where(r.random(g.shape) < 0.3, -80.0, g)
    elif gate_mode == "floor_then_tiny":   # the cumsum-precision case (docs/gdn_math.md)
      g = np.where(np.arange(t)[None, :, None] % 128 < 64, -29.0, -1e-5 * r.random(g.shape))
  kwargs = {}
  if init:
    kwargs["initial_state"] = jnp.asarray(0.5 * normal(b, hv, dk, dv))
  if raw_gate:
    kwargs["a_log"] = jnp.asarray(0.5 * normal(hv))
    if dt_bias:
      kwargs["dt_bias"] = jnp.asarray(0.5 * normal(hv))
  if segments:
    cuts = np.array(sorted({max(1, t // 3), max(1, (2 * t) // 3)}))
    seg = np.sum(np.arange(t)[:, None] >= cuts[None, :], axis=1)
    kwargs["segment_ids"] = jnp.asarray(np.broadcast_to(seg, (b, t)).astype(np.int32))
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(q), cast(k), cast(v), jnp.asarray(g, jnp.float32), cast(beta)), kwargs


CASES = [
    # name, b, t, hk, hv, dk, dv, dtype, gate_mode, raw_gate, init, segments, l2, chunk, interleave
    ("gva1_T1_init", 1, 1, 1, 1, 16, 16, jnp.float32, "plain", False, True, False, True, 64, 1),
    ("gva2_T63_zeros_seg_K16V32", 1, 63, 1, 2, 16, 32, jnp.float32, "zeros", False, True,
     True, True, 64, 2),
    ("gva4_T64_minus80_gate", 1, 64, 1, 4, 16, 16, jnp.float32, "minus80", True, False,
     False, True, 64, 2),
    ("gva2_B2_T65_nol2_groups", 2, 65, 2, 4, 16, 16, jnp.float32, "plain", False, True,
     True, False, 64, 2),
    ("c128_T200_floor_then_tiny", 1, 200, 1, 1, 32, 32, jnp.float32, "floor_then_tiny",
     False, True, False, True, 128, 1),
    ("bf16_gva2_T65_seg", 1, 65, 1, 2, 32, 32, jnp.bfloat16, "zeros", True, True, True, True,
     64, 2),
]


def _loss_fn(impl, kwargs, l2):
  def loss(args, kw_diff, cot):
    q, k, v, g, beta = args
    out, final = tokamax_gdn.gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm=l2, output_final_state=True,
        implementation=impl, **kw_diff, **kwargs)
    return jnp.sum(out.astype(jnp.float32) * cot[0]) + jnp.sum(final * cot[1]), (out, final)
  return loss


def _run(op, args, kwargs, l2, seed=7):
  kw_diff = {n: kwargs.pop(n) for n in ("initial_state", "a_log", "dt_bias") if n in kwargs}
  b, t, hv, dv = args[2].shape
  dk = args[0].shape[-1]
  r = np.random.default_rng(seed)
  cot = (jnp.asarray(r.standard_normal((b, t, hv, dv)), jnp.float32),
         jnp.asarray(r.standard_normal((b, hv, dk, dv)), jnp.float32))
  grad = jax.jit(jax.value_and_grad(_loss_fn(op, kwargs, l2), argnums=(0, 1), has_aux=True))
  with tokamax_gdn.config.interpret_mode():
    (_, (out, final)), grads = grad(args, kw_diff, cot)
  (_, (rout, rfinal)), rgrads = jax.jit(jax.value_and_grad(
      _loss_fn("reference", kwargs, l2), argnums=(0, 1), has_aux=True))(
          jax.tree.map(lambda x: x.astype(jnp.float32), args), kw_diff, cot)
  return (out, final, grads), (rout, rfinal, rgrads), kw_diff


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
  _check_matches_reference(case)


# The forms the kernels take when traced for v5e (the ones libtpu's
# estimator accepts there, `pallas_mosaic_tpu_kernel`) run on the chip: the
# on-chip tier's conformance specs and GDN layer tests, bf16 and float32. The
# stages alone, bf16 and float32, are in pallas_mosaic_tpu_kernel_test.py.


@pytest.mark.parametrize("chip", ["v6e", "tpu7x"])   # v5e: on the chip (tests/tpu)
def test_heads_of_128_lanes_match_reference(chip):
  """Heads of 128 lanes, the other cases' are narrower: the kernels read q,
  k, v (and the backward's dO) from their blocks where the head groups use
  them (`common.head_copies`, `Static.bwd_copies`: the backward's on v5e and
  tpu7x), the NaN guard's selects there; v5e's backward takes dk's K Kᵀ
  terms as one product (`Static.dk_sym`) and the odd heads' T' as stored
  (`common.tmat_transposed`; v5e runs this on the chip). bf16 with segments
  and the prologue."""
  case = ("d128", 1, 130, 1, 2, 128, 128, jnp.bfloat16, "zeros", True, False, True, True, 64, 2)
  tokamax_gdn.config.set_target_chip(chip)
  try:
    _check_matches_reference(case)
  finally:
    tokamax_gdn.config.set_target_chip(None)


@pytest.mark.parametrize("l2,dt_bias,dtype,chip", [(False, True, jnp.float32, None),
                                                   (True, False, jnp.bfloat16, "tpu7x")])
def test_prologue_in_kernel(l2, dt_bias, dtype, chip):
  """The kernels take the raw q, k and gate and run the prologue themselves
  (L2 norm, -exp(a_log)·softplus(g + dt_bias), the -30 floor: a fifth of the
  raw gates are past it): the cases the others leave out, no L2 norm with a
  raw gate and a_log without dt_bias; gradients of q, k, g, a_log (and
  dt_bias) against the reference. Traced for tpu7x the forward kernels
  normalise q, k in place first (`_Static.qk_in_place`)."""
  case = ("prologue", 1, 70, 1, 2, 32, 32, dtype, "floored", True, False, False, l2, 64, 2)
  tokamax_gdn.config.set_target_chip(chip)
  try:
    _check_matches_reference(case, dt_bias=dt_bias)
  finally:
    tokamax_gdn.config.set_target_chip(None)


def test_unrolled_groups_match_reference(monkeypatch):
  """On TPU the head groups run unrolled and the forward kernels invert every
  group's matrices in one list (`_fwd_chunk`); interpret mode runs them in a
  loop unless told otherwise. Three heads per group, so the inverse's pair
  (2, 3) spans two groups; bf16, so one of a pair's T is used transposed."""
  monkeypatch.setattr(pk_call, "_interpret_static",
                      lambda st: dataclasses.replace(st, interpret=True))
  monkeypatch.setattr(pk_common, "unroll_groups", lambda backward=False, steps=None: True)
  _check_matches_reference(("unrolled", 1, 65, 6, 6, 16, 16, jnp.bfloat16, "zeros", True, True,
                            True, True, 64, 3))


@pytest.mark.parametrize("case", [CASES[3], CASES[5]], ids=["f32_B2_groups", "bf16_seg"])
def test_backward_through_vnew_matches_reference(monkeypatch, case):
  """The backward's WY part through V″ = T' (V − K_in S) (`Static.bwd_vnew`,
  v5e's form; v6e's here, so without v5e's other forms): dV = T'ᵀ dV″,
  dK_in = −dV Sᵀ and dA' = −dV V″ᵀ give the reference gradients, float32
  with an initial state, segments and two head groups, and bf16."""
  monkeypatch.setattr(pk_common, "bwd_through_vnew", lambda: True)
  _check_matches_reference(case)


def _check_matches_reference(case, **options):
  (_, b, t, hk, hv, dk, dv, dtype, gate_mode, raw_gate, init, segments, l2, chunk,
   interleave) = case
  args, kwargs = _inputs(t + hv, b=b, t=t, hk=hk, hv=hv, dk=dk, dv=dv, dtype=dtype,
                         gate_mode=gate_mode, raw_gate=raw_gate, init=init,
                         segments=segments, **options)
  op = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(
      config=Config(chunk_size=chunk, interleave=interleave))
  (out, final, grads), (rout, rfinal, rgrads), kw_diff = _run(op, args, kwargs, l2)
  tol, gtol = specs.tolerance(dtype, grad=False), specs.tolerance(dtype, grad=True)
  assert out.dtype == dtype
  assert specs.rel_rms(out, rout) < tol, specs.rel_rms(out, rout)
  assert specs.rel_rms(final, rfinal) < tol, specs.rel_rms(final, rfinal)
  names = ("query", "key", "value", "g", "beta")
  for n, a, e in zip(names, grads[0], rgrads[0]):
    assert jnp.all(jnp.isfinite(a.astype(jnp.float32))), n
    assert specs.rel_rms(a, e) < gtol, (n, specs.rel_rms(a, e))
  for n in kw_diff:
    a, e = grads[1][n], rgrads[1][n]
    assert specs.rel_rms(a, e) < gtol, (n, specs.rel_rms(a, e))


def test_saved_residuals_give_the_reference_gradients():
  """save_states=True: the backward takes the forward's states and WY inverses
  (the other cases recompute them) and its gradients still match."""
  args, kwargs = _inputs(3, b=1, t=40, hk=1, hv=2, dk=16, dv=16, dtype=jnp.float32,
                         gate_mode="plain", raw_gate=False, init=True, segments=False)
  op = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(
      config=Config(chunk_size=64, interleave=2, save_states=True))
  kw_diff = {"initial_state": kwargs["initial_state"]}
  grad_fn = jax.grad(lambda a, kw: _loss_fn(op, {}, True)(a, kw, cot)[0], argnums=(0, 1))
  b, t, hv, dv = args[2].shape
  cot = (jnp.ones((b, t, hv, dv)), jnp.ones((b, hv, 16, dv)))
  with tokamax_gdn.config.interpret_mode():
    program = str(jax.make_jaxpr(grad_fn)(args, kw_diff))
  assert "gdn_fwd_states" not in program and "gdn_bwd" in program   # no recompute pass
  (_, _, grads), (_, _, rgrads), _ = _run(op, args, kwargs, True)
  for a, e in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads)):
    assert specs.rel_rms(a, e) < specs.tolerance(jnp.float32, grad=True)


def _kernel_outputs(jaxpr) -> dict[str, list[tuple[tuple[int, ...], str]]]:
  """{pallas_call name: its outputs' (shape, dtype)} in `jaxpr`, nested ones too."""
  found = {}

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        found[str(eqn.params["name"])] = [(v.aval.shape, str(v.aval.dtype)) for v in eqn.outvars]
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return found


@pytest.mark.parametrize("with_states", [False, True], ids=["none_asked", "both_asked"])
def test_final_state_and_its_initial_gradient_only_when_asked(with_states):
  """output_final_state=False: the forward kernel has no final-state output
  (nor does the backward's states pass); no initial_state: the backward
  kernel has no d_initial output (a state-sized output block that the last
  chunk writes back is an HBM write nothing hides). Asked for, they are
  there. Either way the outputs and gradients match the reference."""
  args, kwargs = _inputs(5, b=1, t=40, hk=1, hv=2, dk=16, dv=16, dtype=jnp.float32,
                         gate_mode="plain", raw_gate=True, init=with_states, segments=False)
  kw_diff = {n: kwargs.pop(n) for n in ("initial_state", "a_log", "dt_bias") if n in kwargs}
  op = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(config=Config(chunk_size=64, interleave=2))
  cot = jnp.asarray(np.random.default_rng(6).standard_normal(args[2].shape), jnp.float32)

  def loss(impl, args, kw):
    out, final = tokamax_gdn.gated_delta_rule(
        *args, use_qk_l2norm=True, output_final_state=with_states, implementation=impl, **kw)
    assert (final is not None) == with_states
    extra = jnp.sum(jnp.square(final)) if with_states else 0.0
    return jnp.sum(out.astype(jnp.float32) * cot) + extra, out

  grad_fn = jax.value_and_grad(functools.partial(loss, op), argnums=(0, 1), has_aux=True)
  with tokamax_gdn.config.interpret_mode():
    kernels = _kernel_outputs(jax.make_jaxpr(grad_fn)(args, kw_diff))
    (_, out), grads = jax.jit(grad_fn)(args, kw_diff)
  state = ((1, 2, 16, 16), "float32")
  assert set(kernels) == {"gdn_fwd", "gdn_fwd_states", "gdn_bwd"}, kernels
  assert (state in kernels["gdn_fwd"]) == with_states, kernels["gdn_fwd"]
  assert state not in kernels["gdn_fwd_states"], kernels["gdn_fwd_states"]
  assert (state in kernels["gdn_bwd"]) == with_states, kernels["gdn_bwd"]
  (_, rout), rgrads = jax.value_and_grad(functools.partial(loss, "reference"), argnums=(0, 1),
                                         has_aux=True)(args, kw_diff)
  tol = specs.tolerance(jnp.float32, grad=False)
  assert specs.rel_rms(out, rout) < tol, specs.rel_rms(out, rout)
  gtol = specs.tolerance(jnp.float32, grad=True)
  for a, e in zip(jax.tree.leaves(grads), jax.tree.leaves(rgrads)):
    assert jnp.all(jnp.isfinite(a)) and specs.rel_rms(a, e) < gtol, specs.rel_rms(a, e)


def test_registered_and_falls_through_off_tpu():
  impl = registry.get("gated_delta_rule", "pallas_mosaic_tpu")
  assert isinstance(impl, pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule)
  assert isinstance(impl.vjp, pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRuleVjp)
  args, _ = _inputs(0, b=1, t=8, hk=1, hv=1, dk=8, dv=8, dtype=jnp.float32,
                    gate_mode="plain", raw_gate=False, init=False, segments=False)
  with tokamax_gdn.config.interpret_mode(False):
    assert not impl.supported_on(jax.devices("cpu")[0])
    with pytest.raises(NotImplementedError):
      tokamax_gdn.gated_delta_rule(*args, implementation="pallas_mosaic_tpu")
    out, _ = tokamax_gdn.gated_delta_rule(
        *args, implementation=("pallas_mosaic_tpu", "reference"))
  assert out.shape == (1, 8, 1, 8)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
def test_heuristics_in_autotuning_configs(chip):
  q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1, 4096, 32), jnp.float32)
  impl = pallas_mosaic_tpu.IMPLEMENTATION
  tokamax_gdn.config.set_target_chip(chip)
  try:
    ba = impl.bind(q, q, v, g, g)
    heur = ba.heuristics_config
    assert heur in ba.autotuning_configs
    assert heur.chunk_size in (64, 128, 256) and 32 % heur.interleave == 0
  finally:
    tokamax_gdn.config.set_target_chip(None)


@pytest.mark.parametrize("t,interleave", [(4096, 16), (8192, 8)])
def test_tpu7x_forward_interleave_follows_the_length(t, interleave):
  """tpu7x's forward at Qwen3-Next heads: 16 heads interleaved fit its 21 MiB
  of scoped VMEM up to T=4096 (measured 20.05 -- 20.5 MiB), not at T=8192 with
  an initial state (over 21.05): the estimate's growth past T=4096 picks 8."""
  q = jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, t, 32, 128), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1, t, 32), jnp.bfloat16)
  tokamax_gdn.config.set_target_chip("tpu7x")
  try:
    heur = pallas_mosaic_tpu.IMPLEMENTATION.bind(q, q, v, g, g).heuristics_config
  finally:
    tokamax_gdn.config.set_target_chip(None)
  assert (heur.chunk_size, heur.interleave) == (128, interleave)


def test_config_past_vmem_is_refused_before_compiling(target_chip):
  """A config whose VMEM estimate is past what the kernels may use on the
  target raises a ValueError naming the op, the kernel, the shapes and the
  figures at trace time (Mosaic's CompileTimeScopedVmemOom names none)."""
  args, kwargs = _inputs(3, b=1, t=64, hk=4, hv=32, dk=128, dv=128, dtype=jnp.float32,
                         gate_mode="plain", raw_gate=False, init=False, segments=False)
  op = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(config=Config(chunk_size=256, interleave=32))
  with tokamax_gdn.config.interpret_mode():
    with pytest.raises(ValueError, match=r"gated_delta_rule pallas_mosaic_tpu: the fwd kernel"
                                         r".* MiB of VMEM.*" + target_chip):
      jax.eval_shape(functools.partial(tokamax_gdn.gated_delta_rule, implementation=op), *args)


def test_autotuning_leaves_a_margin_under_the_vmem_cap():
  """v5e, Qwen3-Next heads: the backward at C = 128 with 32 heads interleaved
  needed 53.25 MiB on the chip (cap 53); the estimate is above that, and
  the sweep leaves out configs within 1/32 of the cap (the heuristics' own
  choice stays)."""
  q = jax.ShapeDtypeStruct((1, 512, 16, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 512, 32, 128), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1, 512, 32), jnp.float32)
  tokamax_gdn.config.set_target_chip("v5e")
  try:
    ba = pallas_mosaic_tpu.IMPLEMENTATION.bind(q, q, v, g, g)
    sh = pallas_mosaic_tpu._shapes(ba)  # pylint: disable=protected-access
    big = pallas_mosaic_tpu.Config(chunk_size=128, interleave=32)
    assert pallas_mosaic_tpu._estimate(big, sh, "bwd") >= 53.25 * 2**20  # pylint: disable=protected-access
    configs = pallas_mosaic_tpu._autotuning_configs(ba, backward=True)  # pylint: disable=protected-access
    assert big not in configs
    assert any(c.interleave == 16 and c.chunk_size == 128 for c in configs)
  finally:
    tokamax_gdn.config.set_target_chip(None)


# Mosaic's scoped VMEM for the backward (MiB) where it failed to compile a
# v5e training step at 64 value heads (Hk=16, K=V=128, bf16, the whole fwd+bwd
# program at a 53 MiB limit; the allocation from the error): T, C, heads
# interleaved -> MiB.
_V5E_BWD_OVER_THE_CAP = {(4096, 128, 8): 53.21, (8192, 128, 4): 53.01, (32768, 128, 4): 55.01,
                         (32768, 128, 2): 55.01, (32768, 128, 1): 55.01}


@pytest.mark.parametrize("t,chunk,max_interleave", [(4096, 128, 4), (8192, 64, 16),
                                                    (32768, 64, 16)])
def test_v5e_backward_at_64_value_heads_fits(t, chunk, max_interleave):
  """The heuristics never pick a backward config that failed to compile on
  v5e at 64 value heads (the estimate is above each measured need), and
  pick one that compiled there (C = 128 with 4 heads at T = 4096, C = 64
  with 16 past it: `tests/aot_test.py` compiles T = 8192)."""
  q = jax.ShapeDtypeStruct((1, t, 16, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, t, 64, 128), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1, t, 64), jnp.bfloat16)
  tokamax_gdn.config.set_target_chip("v5e")
  try:
    ba = pallas_mosaic_tpu.IMPLEMENTATION.bind(q, q, v, g, g)
    sh = pallas_mosaic_tpu._shapes(ba)  # pylint: disable=protected-access
    for (length, c, ilv), mib in _V5E_BWD_OVER_THE_CAP.items():
      if length == t:
        est = pallas_mosaic_tpu._estimate(Config(chunk_size=c, interleave=ilv), sh, "bwd")  # pylint: disable=protected-access
        assert est >= mib * 2**20, (length, c, ilv, est / 2**20, mib)
    cfg = pallas_mosaic_tpu._heuristics(ba, backward=True)  # pylint: disable=protected-access
  finally:
    tokamax_gdn.config.set_target_chip(None)
  assert cfg.chunk_size == chunk and cfg.interleave <= max_interleave, cfg


# Mosaic's scoped VMEM (MiB) where a float32 training step failed to compile
# ahead of time (Hk=16, K=V=128, T=4096, the whole fwd+bwd program at the
# generation's limit; the allocation from the error):
# (chip, Hv, kernel, C, heads interleaved) -> MiB.
_F32_OVER_THE_CAP = {("v5e", 32, "bwd", 128, 16): 56.36, ("v6e", 32, "bwd", 128, 16): 57.08,
                     ("v5e", 48, "bwd", 128, 6): 63.46, ("v5e", 64, "fwd", 128, 16): 54.64,
                     ("v5e", 64, "fwd", 128, 8): 54.71, ("tpu7x", 32, "fwd", 128, 8): 24.5,
                     ("tpu7x", 32, "fwd", 128, 4): 23.09, ("tpu7x", 32, "bwd", 64, 2): 23.17}


@pytest.mark.parametrize("key", list(_F32_OVER_THE_CAP), ids=str)
def test_float32_estimate_is_above_what_failed(key):
  """float32's VMEM estimate is above each allocation that overflowed (so
  the heuristics never pick those configs, and an explicit one is refused
  with a clear error where it cannot fit)."""
  chip, hv, kind, chunk, ilv = key
  q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.float32)
  v = jax.ShapeDtypeStruct((1, 4096, hv, 128), jnp.float32)
  g = jax.ShapeDtypeStruct((1, 4096, hv), jnp.float32)
  tokamax_gdn.config.set_target_chip(chip)
  try:
    sh = pallas_mosaic_tpu._shapes(pallas_mosaic_tpu.IMPLEMENTATION.bind(q, q, v, g, g))  # pylint: disable=protected-access
    est = pallas_mosaic_tpu._estimate(Config(chunk_size=chunk, interleave=ilv), sh, kind)  # pylint: disable=protected-access
  finally:
    tokamax_gdn.config.set_target_chip(None)
  assert est >= _F32_OVER_THE_CAP[key] * 2**20, (key, est / 2**20)
