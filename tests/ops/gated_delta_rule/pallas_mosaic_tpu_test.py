"""pallas_mosaic_tpu gated delta rule vs the reference, in Pallas interpret mode.

Shapes are tiny (interpret mode on CPU is slow); each case combines several
features so the whole file stays well under a few minutes on one core.
Compiling for real TPU generations is in tests/aot_test.py.
"""

import jax
import jax.numpy as jnp
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu
from tokamax_gdn.testing import specs

Config = pallas_mosaic_tpu.Config


def _inputs(key, *, b, t, hk, hv, d, dtype, gate_mode, raw_gate, init, segments):
  ks = jax.random.split(key, 10)
  q = jax.random.normal(ks[0], (b, t, hk, d), jnp.float32)
  k = jax.random.normal(ks[1], (b, t, hk, d), jnp.float32)
  v = jax.random.normal(ks[2], (b, t, hv, d), jnp.float32)
  beta = jax.nn.sigmoid(jax.random.normal(ks[3], (b, t, hv)))
  if raw_gate:
    g = jax.random.normal(ks[4], (b, t, hv))
  else:
    g = -jax.nn.softplus(jax.random.normal(ks[4], (b, t, hv)) - 1.0)
    if gate_mode == "zeros":
      g = jnp.where(jax.random.bernoulli(ks[5], 0.5, g.shape), 0.0, g)
    elif gate_mode == "minus80":
      g = jnp.where(jax.random.bernoulli(ks[5], 0.3, g.shape), -80.0, g)
  kwargs = {}
  if init:
    kwargs["initial_state"] = 0.5 * jax.random.normal(ks[6], (b, hv, d, d))
  if raw_gate:
    kwargs["a_log"] = jax.random.normal(ks[7], (hv,)) * 0.5
    kwargs["dt_bias"] = jax.random.normal(ks[8], (hv,)) * 0.5
  if segments:
    cuts = jnp.array(sorted({max(1, t // 3), max(1, (2 * t) // 3)}))
    seg = jnp.sum(jnp.arange(t)[:, None] >= cuts[None, :], axis=1)
    kwargs["segment_ids"] = jnp.broadcast_to(seg, (b, t)).astype(jnp.int32)
  cast = lambda x: x.astype(dtype)
  return (cast(q), cast(k), cast(v), g, beta), kwargs


CASES = [
    # name, b, t, hk, hv, d, dtype, gate_mode, raw_gate, init, segments, l2, chunk, hb
    ("gva1_T1_init", 1, 1, 1, 1, 16, jnp.float32, "plain", False, True, False, True, 32, 1),
    ("gva2_T63_zeros_seg", 1, 63, 1, 2, 16, jnp.float32, "zeros", False, True, True, True, 32, 2),
    ("gva4_T64_minus80_gate", 1, 64, 1, 4, 16, jnp.float32, "minus80", True, False, False, True, 32, 4),
    ("gva2_T65_nol2_2heads", 2, 65, 2, 4, 16, jnp.float32, "plain", False, True, True, False, 32, 4),
    ("gva1_T200_c128_seg", 1, 200, 1, 1, 32, jnp.float32, "zeros", True, True, True, True, 128, 1),
    ("bf16_gva2_T65", 1, 65, 1, 2, 32, jnp.bfloat16, "zeros", True, True, True, True, 32, 2),
]


def _loss_fn(impl, cfg_op, kwargs, l2, output_final_state=True):
  def loss(args, kw_diff, cot):
    q, k, v, g, beta = args
    out, final = tokamax_gdn.gated_delta_rule(
        q, k, v, g, beta, use_qk_l2norm=l2, output_final_state=output_final_state,
        implementation=cfg_op if impl == "pallas" else "reference",
        **kw_diff, **kwargs)
    l = jnp.sum(out.astype(jnp.float32) * cot[0])
    if final is not None:
      l = l + jnp.sum(final * cot[1])
    return l, (out, final)
  return loss


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_reference(case):
  name, b, t, hk, hv, d, dtype, gate_mode, raw_gate, init, segments, l2, chunk, hb = case
  del name
  args, kwargs = _inputs(jax.random.PRNGKey(t + hv), b=b, t=t, hk=hk, hv=hv, d=d,
                         dtype=dtype, gate_mode=gate_mode, raw_gate=raw_gate,
                         init=init, segments=segments)
  kw_diff = {n: kwargs.pop(n) for n in ("initial_state", "a_log", "dt_bias") if n in kwargs}
  cot = (jax.random.normal(jax.random.PRNGKey(7), (b, t, hv, d)),
         jax.random.normal(jax.random.PRNGKey(8), (b, hv, d, d)))
  op = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(
      config=Config(chunk_size=chunk, block_heads=hb))
  ref_loss = _loss_fn("reference", None, kwargs, l2)
  with tokamax_gdn.config.interpret_mode():
    (_, (out, final)), grads = jax.value_and_grad(
        _loss_fn("pallas", op, kwargs, l2), argnums=(0, 1), has_aux=True)(args, kw_diff, cot)
  (_, (rout, rfinal)), rgrads = jax.value_and_grad(
      ref_loss, argnums=(0, 1), has_aux=True)(
          jax.tree.map(lambda x: x.astype(jnp.float32), args), kw_diff, cot)

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


def test_saved_states_match_recompute():
  args, kwargs = _inputs(jax.random.PRNGKey(3), b=1, t=40, hk=1, hv=2, d=16,
                         dtype=jnp.float32, gate_mode="plain", raw_gate=False,
                         init=False, segments=False)
  cot = (jax.random.normal(jax.random.PRNGKey(1), (1, 40, 2, 16)), None)
  grads = []
  for save in (False, True):
    op = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(
        config=Config(chunk_size=32, block_heads=2, save_states=save))
    with tokamax_gdn.config.interpret_mode():
      grads.append(jax.grad(lambda a: _loss_fn("pallas", op, kwargs, True, False)(
          a, {}, cot)[0])(args))
  for a, e in zip(*grads):
    assert specs.rel_rms(a, e) < 1e-6


def test_registered_and_falls_through_off_tpu():
  impl = registry.get("gated_delta_rule", "pallas_mosaic_tpu")
  assert isinstance(impl, pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule)
  assert isinstance(impl.vjp, pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRuleVjp)
  args, kwargs = _inputs(jax.random.PRNGKey(0), b=1, t=8, hk=1, hv=1, d=8,
                         dtype=jnp.float32, gate_mode="plain", raw_gate=False,
                         init=False, segments=False)
  with tokamax_gdn.config.interpret_mode(False):
    assert not impl.supported_on(jax.devices("cpu")[0])
    with pytest.raises(ExceptionGroup):
      tokamax_gdn.gated_delta_rule(*args, implementation="pallas_mosaic_tpu")
    out, _ = tokamax_gdn.gated_delta_rule(
        *args, implementation=("pallas_mosaic_tpu", "reference"))
  assert out.shape == (1, 8, 1, 8)


def test_heuristics_in_autotuning_configs():
  import tokamax_gdn.config as cfg  # pylint: disable=g-import-not-at-top
  q = jax.ShapeDtypeStruct((1, 4096, 16, 128), jnp.bfloat16)
  v = jax.ShapeDtypeStruct((1, 4096, 32, 128), jnp.bfloat16)
  g = jax.ShapeDtypeStruct((1, 4096, 32), jnp.float32)
  impl = pallas_mosaic_tpu.IMPLEMENTATION
  for chip in ("v5e", "v6e", "tpu7x"):
    cfg.set_target_chip(chip)
    try:
      ba = impl.bind(q, q, v, g, g)
      heur = ba.heuristics_config
      assert heur in ba.autotuning_configs
      assert heur.block_heads % 2 == 0 and 32 % heur.block_heads == 0
    finally:
      cfg.set_target_chip(None)
