"""The decoder: presets, config checks, scan vs loop vs remat (custom VJPs
inside `lax.scan` and `jax.checkpoint`), xla vs reference ops, bf16."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import layers
from tokamax_gdn import models
from tokamax_gdn.models import ModelConfig
from tokamax_gdn.testing.specs import rel_rms, tolerance

GDN = layers.GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                 head_v_dim=16)
CFG = ModelConfig(gdn=GDN, num_layers=4, full_attention_interval=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                  moe_intermediate_size=24, vocab_size=16)


def _tokens(b=2, t=12, seed=0):
  return jnp.asarray(np.random.default_rng(seed).integers(0, CFG.vocab_size, (b, t)), jnp.int32)


def _params(cfg=CFG, seed=0, dtype=jnp.float32):
  # Norm weights away from their zero init so every parameter matters.
  p = models.init_params(jax.random.key(seed), cfg, dtype)
  rng = np.random.default_rng(seed + 1)
  return jax.tree_util.tree_map_with_path(
      lambda path, a: a + jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype)
      if "norm" in str(path[-1]) else a, p)


def _loss(params, tokens, cfg=CFG, **kw):
  # Without remat unless asked: half the compile, and remat has its own test.
  logits, stats = models.forward(params, tokens, cfg, **{"remat": False, **kw})
  return jnp.mean(jnp.sin(logits)) + 0.1 * stats["aux_loss"]


def test_presets_micro_and_tiny_share_the_structure():
  micro, tiny = ModelConfig.load("qwen3.5-micro"), ModelConfig.load("qwen3.5-tiny")
  for cfg in (micro, tiny):
    assert cfg.gdn.num_v_heads == 2 * cfg.gdn.num_k_heads          # GVA 1:2
    assert cfg.block_kinds == ("gdn", "gdn", "gdn", "attention")  # 3 GDN : 1 attention
    assert cfg.num_experts_per_tok == 2
  assert micro.hidden_size < tiny.hidden_size
  assert layers.load_preset("qwen3.5-micro") == micro.gdn          # the layer reads it too
  assert micro.replace(hidden_size=64).gdn.hidden_size == 64
  with pytest.raises(ValueError, match="no `model:` section"):
    ModelConfig.load("qwen3-next-80b-a3b")


@pytest.mark.parametrize("change, match", [
    (dict(num_layers=3), "multiple of"),
    (dict(full_attention_interval=1), ">= 2"),
    (dict(num_experts_per_tok=5), "exceeds"),
    (dict(num_key_value_heads=3), "multiple of"),
    (dict(capacity_factor=0.0), "positive"),
    (dict(head_dim=7), "even"),
])
def test_config_errors(change, match):
  with pytest.raises(ValueError, match=match):
    dataclasses.replace(CFG, **change)


def test_params_layout_and_block_kinds():
  p = models.init_params(jax.random.key(0), CFG)
  assert p["blocks"]["gdn"]["gdn"]["in_proj"].shape == (2, 1, 32, GDN.in_proj_dim)
  assert p["blocks"]["attention"]["attn"]["q_proj"].shape == (2, 32, 32)
  assert p["blocks"]["gdn"]["gdn"]["a_log"].dtype == jnp.float32
  all_gdn = dataclasses.replace(CFG, full_attention_interval=0)
  assert all_gdn.block_kinds == ("gdn",) * 4
  p_all = models.init_params(jax.random.key(0), all_gdn)
  assert "attention" not in p_all["blocks"]
  # Scan over blocks of one kind only (traced, not run).
  out = jax.eval_shape(lambda p: models.forward(p, _tokens(), all_gdn, implementation="xla")[0],
                       p_all)
  assert out.shape == (2, 12, CFG.vocab_size)
  with pytest.raises(ValueError, match=r"\[B, T\]"):
    models.forward(p, jnp.zeros((4,), jnp.int32), CFG)


def test_scan_and_remat_match_python_loop():
  """The per-block loop against `lax.scan` over blocks, without and with
  `jax.checkpoint` (the training and the AOT train-step configurations), and
  with the policy that saves the GDN op's named residuals: the custom VJPs
  inside scan and remat give the loop's logits and gradients."""
  cfg = CFG
  params, tokens = _params(cfg), _tokens()

  def run(scan, remat, remat_policy="recompute"):
    def loss(p):
      logits, stats = models.forward(p, tokens, cfg, implementation="xla", scan=scan,
                                     remat=remat, remat_policy=remat_policy)
      return jnp.mean(jnp.sin(logits)) + 0.1 * stats["aux_loss"], (logits, stats)
    (_, aux), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return aux, grads

  (logits, stats), grads = run(False, False)
  assert stats["group_sizes"].shape == (4, 4)
  np.testing.assert_array_equal(stats["group_sizes"].sum(-1), 2 * 12 * 2)   # dropless
  for scan, remat, policy in [(True, False, "recompute"), (True, True, "recompute"),
                              (True, True, "save_gdn")]:
    (l2, s2), g2 = run(scan, remat, policy)
    np.testing.assert_allclose(l2, logits, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(s2["group_sizes"], stats["group_sizes"])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g2), jax.tree.leaves(grads)):
      assert rel_rms(a, b) < 1e-5, (scan, remat, policy, jax.tree_util.keystr(path))


def test_xla_ops_match_reference_ops():
  params, tokens = _params(), _tokens(t=10)
  run = lambda impl: jax.jit(jax.value_and_grad(
      lambda p: _loss(p, tokens, implementation=impl)))(params)
  (l_x, g_x), (l_r, g_r) = run("xla"), run("reference")
  assert abs(float(l_x) - float(l_r)) < 1e-5
  for a, b in zip(jax.tree.leaves(g_x), jax.tree.leaves(g_r)):
    assert rel_rms(a, b) < tolerance(jnp.float32, grad=True)


def test_bf16_activations_and_bf16_params():
  params, tokens = _params(), _tokens()
  forward = jax.jit(lambda p, dtype: models.forward(p, tokens, CFG, implementation="xla",
                                                    dtype=dtype, remat=False)[0],
                    static_argnums=1)
  logits32, logits16 = forward(params, None), forward(params, jnp.bfloat16)
  assert logits16.dtype == jnp.float32                 # the head accumulates in f32
  assert rel_rms(logits16, logits32) < 4 * tolerance(jnp.bfloat16, grad=False)
  p16 = _params(dtype=jnp.bfloat16)
  assert p16["blocks"]["gdn"]["gdn"]["a_log"].dtype == jnp.float32   # gates stay f32
  assert p16["blocks"]["gdn"]["moe"]["router"].dtype == jnp.float32
  grads = jax.jit(jax.grad(lambda p: _loss(p, tokens, implementation="xla")))(p16)
  for g, p in zip(jax.tree.leaves(grads), jax.tree.leaves(p16)):
    assert g.dtype == p.dtype and bool(jnp.all(jnp.isfinite(g.astype(jnp.float32))))
