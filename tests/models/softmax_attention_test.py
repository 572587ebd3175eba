"""The attention core: splash attention (Pallas interpret mode on CPU) against
the jnp formula, forward and gradients; which core runs when."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn.models import blocks
from tokamax_gdn.models import softmax_attention as sa
from tokamax_gdn.testing.specs import rel_rms


def _qkv(seed, b, t, heads, kv_heads, d, dtype):
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return (jax.random.normal(kq, (b, t, heads, d)).astype(dtype),
          jax.random.normal(kk, (b, t, kv_heads, d)).astype(dtype),
          jax.random.normal(kv, (b, t, kv_heads, d)).astype(dtype))


def test_splash_block_is_the_largest_that_divides():
  assert sa.splash_block(4096) == 512
  assert sa.splash_block(768) == 256
  assert sa.splash_block(384) == 128
  assert sa.splash_block(16) is None
  assert sa.splash_block(200) is None


@pytest.mark.skipif(config.on_tpu(), reason="the choices off TPU")
def test_core_choice_off_tpu():
  for impl in (None, "pallas_mosaic_tpu", "xla"):
    assert sa.core_for(impl, 256) == sa.XLA, impl       # no TPU, no interpret mode
  with config.interpret_mode(True):
    assert sa.core_for("pallas_mosaic_tpu", 256) == sa.SPLASH
    assert sa.core_for(("pallas_mosaic_tpu", "xla"), 256) == sa.SPLASH
    assert sa.core_for({"attention": "pallas_mosaic_tpu"}, 256) == sa.SPLASH
    assert sa.core_for({"gated_delta_rule": "pallas_mosaic_tpu"}, 256) == sa.XLA
    assert sa.core_for("pallas_mosaic_tpu", 16) == sa.XLA     # T: no whole block
    assert sa.core_for("xla", 256) == sa.XLA
    assert sa.core_for("reference", 256) == sa.XLA
    assert sa.core_for(None, 256) == sa.XLA                  # the default off TPU


@pytest.mark.parametrize("dtype,out_tol,grad_tol", [
    (jnp.float32, 2e-4, 2e-3), (jnp.bfloat16, 2e-2, 2e-2)])
def test_splash_matches_the_formula(dtype, out_tol, grad_tol):
  """GQA (4 query heads on 2 key/value heads), T = 256 (one 256-token
  block): out and the gradients of q, k, v under a random cotangent."""
  q, k, v = _qkv(0, 2, 256, 4, 2, 64, dtype)
  cot = jax.random.normal(jax.random.key(1), q.shape).astype(dtype)

  def run(f):
    out, vjp = jax.vjp(f, q, k, v)
    return out, vjp(cot)

  with config.interpret_mode(True):
    got, got_grads = jax.jit(lambda: run(sa.splash_attention))()
  want, want_grads = jax.jit(lambda: run(sa.xla_attention))()
  assert got.dtype == dtype and got.shape == q.shape
  assert rel_rms(got, want) < out_tol
  for g, w, name in zip(got_grads, want_grads, "qkv"):
    assert g.dtype == dtype, name
    assert rel_rms(g, w) < grad_tol, name


def test_attention_block_with_kernels_matches_xla():
  """The whole attention block (projections, norms, rope) with the Pallas
  core equals the jnp one, forward and every gradient."""
  hidden, heads, kv_heads, d = 32, 2, 1, 64
  params = blocks.init_attention(jax.random.key(2), hidden, heads, kv_heads, d, jnp.float32)
  x = jax.random.normal(jax.random.key(3), (1, 128, hidden))
  kw = dict(heads=heads, kv_heads=kv_heads, head_dim=d, eps=1e-6, rope_theta=1e4)

  def grads(impl):
    f = lambda p, x: jnp.sum(jnp.sin(blocks.attention(p, x, implementation=impl, **kw)))
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1)))(params, x)

  with config.interpret_mode(True):
    got_loss, got = grads("pallas_mosaic_tpu")
  want_loss, want = grads("xla")
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-4)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
    assert rel_rms(g, w) < 2e-3, jax.tree_util.keystr(path)


def test_uneven_heads_are_refused():
  q, k, v = _qkv(0, 1, 16, 3, 2, 8, jnp.float32)
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    sa.causal_attention(q, k, v)
