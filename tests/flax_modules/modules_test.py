"""NNX modules: params round-trip to HF names, and the modules compute exactly
what the functional API computes (forward and gradients)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from tokamax_gdn import layers  # pylint: disable=g-import-not-at-top
from tokamax_gdn import models  # pylint: disable=g-import-not-at-top
from tokamax_gdn.flax import Attention, DecoderBlock, GatedDeltaNet, MoE  # pylint: disable=g-import-not-at-top,g-multiple-import
from tokamax_gdn.testing.specs import rel_rms  # pylint: disable=g-import-not-at-top
from tests.layers.gated_deltanet_test import load_fixture  # pylint: disable=g-import-not-at-top

GDN_CFG = layers.GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4,
                                     head_k_dim=16, head_v_dim=16)
MODEL_CFG = models.ModelConfig(gdn=GDN_CFG, num_layers=2, full_attention_interval=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                               vocab_size=16)


def _x(shape=(2, 12, 32), seed=0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), jnp.float32)


def _assert_trees_equal(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


@pytest.mark.parametrize("variant", ["qwen3_5", "qwen3_next"])
def test_gdn_from_hf_to_hf_round_trip_and_hf_outputs(variant):
  d, cfg, sd = load_fixture(variant)
  module = GatedDeltaNet.from_hf(sd, cfg, implementation="xla")
  back = module.to_hf()
  assert set(back) == set(sd)
  for name, value in sd.items():
    np.testing.assert_array_equal(back[name], value, err_msg=name)
  # The module reproduces HF's own outputs (fixture made with transformers).
  assert rel_rms(nnx.jit(lambda m, x: m(x))(module, jnp.asarray(d["x"])), d["y"]) < 2e-4


def test_gdn_module_equals_functional_layer_exactly():
  module = GatedDeltaNet(GDN_CFG, rngs=nnx.Rngs(3), implementation="xla")
  params = module.params()
  # Initialised as the functional API initialises (HF's init).
  _assert_trees_equal(params, layers.init_params(nnx.Rngs(3).params(), GDN_CFG))
  x = _x()
  # Both sides jitted (eager dispatch compiles each primitive on its own:
  # ~800 compiles here).
  np.testing.assert_array_equal(
      nnx.jit(lambda m, x: m(x))(module, x),
      jax.jit(lambda p, x: layers.gated_deltanet(p, x, GDN_CFG, implementation="xla"))(
          params, x))

  cot = _x(seed=1)
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) * cot)))(module)
  want = jax.jit(jax.grad(lambda p: jnp.sum(
      layers.gated_deltanet(p, x, GDN_CFG, implementation="xla") * cot)))(params)
  for name, g in want.items():
    np.testing.assert_array_equal(getattr(grads, name)[...], g, err_msg=name)


def test_gdn_module_decode_cache_matches_layer():
  module = GatedDeltaNet(GDN_CFG, rngs=nnx.Rngs(0), implementation="xla")
  x = _x()
  step = nnx.jit(lambda m, x, cache: m(x, cache=cache, return_cache=True))
  y, cache = step(module, x[:, :8], None)
  y2, _ = step(module, x[:, 8:], cache)
  layer = jax.jit(lambda p, x, cache: layers.gated_deltanet(
      p, x, GDN_CFG, implementation="xla", cache=cache, return_cache=True))
  want, cache_w = layer(module.params(), x[:, :8], None)
  want2, _ = layer(module.params(), x[:, 8:], cache_w)
  np.testing.assert_array_equal(y, want)
  np.testing.assert_array_equal(y2, want2)


def test_gdn_module_rejects_wrong_params():
  params = layers.init_params(jax.random.key(0), GDN_CFG)
  params["out_proj"] = params["out_proj"][:-1]
  with pytest.raises(ValueError, match="expected shapes"):
    GatedDeltaNet(GDN_CFG, params=params)
  with pytest.raises(TypeError, match="rngs"):
    GatedDeltaNet(GDN_CFG)


def test_moe_and_attention_modules_equal_functions():
  x = _x()
  moe = MoE(MODEL_CFG, rngs=nnx.Rngs(1), implementation="xla")
  y, stats = moe(x)
  y_want, stats_want = models.moe(moe.params(), x, top_k=2, implementation="xla")
  np.testing.assert_array_equal(y, y_want)
  np.testing.assert_array_equal(stats["group_sizes"], stats_want["group_sizes"])
  attn = Attention(MODEL_CFG, rngs=nnx.Rngs(2))
  np.testing.assert_array_equal(
      attn(x), models.attention(attn.params(), x, heads=4, kv_heads=2, head_dim=8, eps=1e-6,
                                rope_theta=1e4))


@pytest.mark.parametrize("kind", ["gdn", "attention"])
def test_decoder_block_equals_functional_block(kind):
  block = DecoderBlock(MODEL_CFG, kind, rngs=nnx.Rngs(5), implementation="xla")
  params = block.params()
  _assert_trees_equal(params, models.init_block(nnx.Rngs(5).params(), MODEL_CFG, kind))
  x = _x()
  # Both sides jitted (eagerly the block compiled ~870 tiny XLA programs).
  functional = lambda p, x: models.block(p, x, MODEL_CFG, kind, implementation="xla")
  (y, _), (y_want, _) = nnx.jit(lambda m, x: m(x))(block, x), jax.jit(functional)(params, x)
  np.testing.assert_array_equal(y, y_want)

  loss = lambda y_stats: jnp.sum(y_stats[0] ** 2) + y_stats[1]["aux_loss"]
  grads = nnx.jit(nnx.grad(lambda m, x: loss(m(x))))(block, x)
  want = jax.jit(jax.grad(lambda p, x: loss(functional(p, x))))(params, x)
  got = dict(input_norm=grads.input_norm[...], post_norm=grads.post_norm[...],
             moe={k: getattr(grads.moe, k)[...] for k in want["moe"]})
  mixer = "gdn" if kind == "gdn" else "attn"
  got[mixer] = {k: getattr(grads.mixer, k)[...] for k in want[mixer]}
  _assert_trees_equal(got, want)
  assert float(jnp.abs(got["moe"]["router"]).max()) > 0   # the router is trained
