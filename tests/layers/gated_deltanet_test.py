"""GatedDeltaNet layer: HF parity (forward + every gradient), cache, segments, weight mapping.

The golden files in fixtures/ come from `tools/make_hf_fixtures.py`, run with
torch + transformers (HF `Qwen3NextGatedDeltaNet` / `Qwen3_5GatedDeltaNet`,
float32, hidden 64, Hk 2, Hv 4, K = V = 16, B 2, T 40); these tests need
neither.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.layers import (  # pylint: disable=g-multiple-import
    GatedDeltaNetCache, GatedDeltaNetConfig, gated_deltanet, init_params, list_presets,
    load_preset, param_shapes, params_from_hf, params_to_hf)
from tokamax_gdn.testing.specs import rel_rms

from tests import doc_blocks

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
VARIANTS = ("qwen3_next", "qwen3_5")
OPS = ("causal_conv1d", "gated_delta_rule")


def load_fixture(variant):
  d = np.load(os.path.join(FIXTURES, f"hf_{variant}.npz"))
  cfg = GatedDeltaNetConfig.from_hf_config(json.loads(str(d["hf_config"])), variant=variant)
  sd = {k[len("param/"):]: d[k] for k in d.files if k.startswith("param/")}
  return d, cfg, sd


def implementation_for(name):
  """`implementation=` for the layer, or a skip reason."""
  have = {op: registry.implementations(op) for op in OPS}
  if name != "pallas_mosaic_tpu":
    return name, None
  present = [op for op in OPS if name in have[op]]
  if not present:
    return None, "pallas_mosaic_tpu is registered for neither causal_conv1d nor gated_delta_rule"
  # Where one op has no kernel yet, that op runs xla; the other runs interpreted.
  return {op: (name if op in present else "xla") for op in OPS}, None


def context_for(name):
  if name == "pallas_mosaic_tpu" and not config.on_tpu():
    return config.interpret_mode(True)
  import contextlib  # pylint: disable=g-import-not-at-top
  return contextlib.nullcontext()


# Each implementation once, each variant at least once: the variants differ
# only in the weight layout (checked exactly by the round-trip tests below).
@pytest.mark.parametrize("variant,impl_name", [
    ("qwen3_next", "reference"), ("qwen3_5", "xla"), ("qwen3_next", "pallas_mosaic_tpu")])
def test_hf_parity_forward_and_grads(variant, impl_name):
  impl, reason = implementation_for(impl_name)
  if reason:
    pytest.skip(reason)
  d, cfg, sd = load_fixture(variant)
  params = params_from_hf(sd, cfg)
  with context_for(impl_name):
    @jax.jit   # one compile (eager dispatch compiles each primitive: ~600 here)
    def fwd_vjp(params, x, cot):
      y, vjp = jax.vjp(lambda p, x: gated_deltanet(p, x, cfg, implementation=impl), params, x)
      return y, vjp(cot)
    y, (grads, grad_x) = fwd_vjp(params, jnp.asarray(d["x"]), jnp.asarray(d["cot"]))
  assert y.dtype == jnp.float32
  assert rel_rms(y, d["y"]) < 2e-4
  assert rel_rms(grad_x, d["grad_x"]) < 2e-3
  hf_grads = params_to_hf(grads, cfg)
  assert set(hf_grads) == set(sd)
  for name, g in hf_grads.items():
    assert rel_rms(g, d[f"grad/{name}"]) < 2e-3, name


def test_mixed_implementations_per_op():
  d, cfg, sd = load_fixture("qwen3_5")
  y = gated_deltanet(params_from_hf(sd, cfg), jnp.asarray(d["x"]), cfg,
                     implementation={"causal_conv1d": "xla", "gated_delta_rule": "reference"})
  assert rel_rms(y, d["y"]) < 2e-4


def test_default_implementation_and_chunk_size():
  d, cfg, sd = load_fixture("qwen3_next")
  params, x = params_from_hf(sd, cfg), jnp.asarray(d["x"])
  for c in (16, 32):
    y = jax.jit(functools.partial(
        gated_deltanet, cfg=dataclasses.replace(cfg, chunk_size=c, use_gdn_kernel=False)))(
            params, x)
    assert rel_rms(y, d["y"]) < 2e-4


def layer(cfg, impl, **kw):
  """The layer jitted once per (cfg, impl): eager op-by-op dispatch is slow."""
  return jax.jit(functools.partial(gated_deltanet, cfg=cfg, implementation=impl, **kw))


def _small_cfg(**kw):
  return GatedDeltaNetConfig(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=16,
                             head_v_dim=8, conv_kernel_size=4, **kw)


@pytest.mark.parametrize("prefill", [1, 7])
def test_prefill_then_decode_equals_full(prefill):
  cfg = _small_cfg()
  params = init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (2, 11, cfg.hidden_size))
  run = layer(cfg, "xla", return_cache=True)
  y_full, cache_full = run(params, x)
  y, cache = run(params, x[:, :prefill])
  ys = [y]
  for t in range(prefill, x.shape[1]):
    y, cache = run(params, x[:, t:t + 1], cache=cache)
    ys.append(y)
  np.testing.assert_allclose(jnp.concatenate(ys, axis=1), y_full, rtol=2e-4, atol=2e-5)
  for a, b in zip(cache, cache_full):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)


def test_cache_zeros_is_no_cache():
  cfg = _small_cfg()
  params = init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (1, 5, cfg.hidden_size))
  run = layer(cfg, "xla")
  np.testing.assert_allclose(run(params, x), run(params, x, cache=GatedDeltaNetCache.zeros(1, cfg)),
                             rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", ["reference", "xla"])
def test_segments_do_not_leak(impl):
  cfg = _small_cfg()
  params = init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (3, 14, cfg.hidden_size))
  seg = jnp.array([[0] * 6 + [1] * 8] * 3, jnp.int32)
  # Row 1: segment 2 perturbed; row 2: segment 1 perturbed.
  x = x.at[1].set(x[0].at[6:].add(3.0)).at[2].set(x[0].at[:6].add(3.0))
  y = layer(cfg, impl)(params, x, segment_ids=seg)
  np.testing.assert_array_equal(y[0, :6], y[1, :6])       # causality
  np.testing.assert_allclose(y[0, 6:], y[2, 6:], rtol=1e-6, atol=1e-7)   # no leak forward
  assert not np.allclose(y[0, :6], y[2, :6])
  # Segment 2 packed == segment 2 alone.
  y_alone = layer(cfg, impl)(params, x[:1, 6:])
  np.testing.assert_allclose(y[:1, 6:], y_alone, rtol=1e-5, atol=1e-6)


# Pallas: the GDN op's isolation is tested per implementation in
# tests/ops/gated_delta_rule/isolation_test.py (Pallas included) and the conv's
# in its tests; the layer adds nothing implementation-specific, so it runs on
# the two implementations that compile fast on CPU.
def _nan_test_inputs(impl_name):
  """(impl, cfg, params, x [2, 20, hidden]) of the layer's NaN-isolation tests."""
  impl, reason = implementation_for(impl_name)
  if reason:
    pytest.fail(reason)
  cfg = _small_cfg()
  params = init_params(jax.random.key(0), cfg)
  return impl, cfg, params, jax.random.normal(jax.random.key(1), (2, 20, cfg.hidden_size))


@pytest.mark.parametrize("impl_name", ["reference", "xla"])
def test_nan_in_one_segment_stays_there(impl_name):
  """A NaN and an inf in segment 1's activations (and a NaN in its output
  cotangent) reach neither segment 0's nor segment 2's outputs or input
  gradients, nor the returned cache (segment 2 ends the rows). The parameter
  gradients sum over every token, segment 1's included."""
  impl, cfg, params, x = _nan_test_inputs(impl_name)
  seg = jnp.array([[0] * 6 + [1] * 7 + [2] * 7] * 2, jnp.int32)
  cot = jax.random.normal(jax.random.key(2), x.shape)
  keep = np.r_[0:6, 13:20]

  def run(x, cot):
    f = lambda x: layer(cfg, impl, segment_ids=seg, return_cache=True)(params, x)
    with context_for(impl_name):
      (y, cache), vjp = jax.vjp(f, x)
      (dx,) = vjp((cot, jax.tree.map(jnp.ones_like, cache)))
    return y, cache, dx

  y, cache, dx = run(x, cot)
  y_p, cache_p, dx_p = run(x.at[:, 8, 3].set(jnp.nan).at[:, 10, 5].set(jnp.inf),
                           cot.at[:, 9, 1].set(jnp.nan))
  assert np.isnan(np.asarray(y_p[:, 6:13])).any()
  np.testing.assert_array_equal(y_p[:, keep], y[:, keep])
  np.testing.assert_array_equal(dx_p[:, keep], dx[:, keep])
  for a, b in zip(cache_p, cache):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("impl_name", ["reference", "xla"])
def test_nan_does_not_flow_backwards_in_time(impl_name):
  """No segment_ids, garbage (NaN) from token 12 of row 0, as in a right
  padding, and a loss that masks those tokens with `where`: the outputs
  before it are as without the garbage, and the input gradients before the
  conv's window (the W - 1 tokens whose gradients read the conv outputs at
  and after the garbage, where silu's and the L2 norm's backward of a NaN
  activation is NaN under a zero cotangent) are finite; row 1 is untouched."""
  impl, cfg, params, x = _nan_test_inputs(impl_name)
  cot = jax.random.normal(jax.random.key(2), x.shape)
  t0 = 12
  mask = (jnp.arange(x.shape[1]) < t0)[None, :, None]
  run = layer(cfg, impl)

  def grad(x):
    def loss(x):
      y = run(params, x)
      return jnp.sum(jnp.where(mask, y * cot, 0.0)), y
    with context_for(impl_name):
      return jax.grad(loss, has_aux=True)(x)

  dx, y = grad(x)
  dx_p, y_p = grad(x.at[0, t0:].set(jnp.nan))
  np.testing.assert_array_equal(y_p[:, :t0], y[:, :t0])
  np.testing.assert_array_equal(y_p[1], y[1])
  assert np.isnan(np.asarray(y_p[0, t0:])).all()
  np.testing.assert_allclose(dx_p[0, :t0 - cfg.conv_kernel_size + 1],
                             dx[0, :t0 - cfg.conv_kernel_size + 1], rtol=1e-4, atol=1e-6)
  np.testing.assert_array_equal(dx_p[1], dx[1])


@pytest.mark.parametrize("chunk", [0, 48, 256])
def test_chunk_size_outside_the_xla_configs_is_refused(chunk):
  with pytest.raises(ValueError, match=r"16, 32, 64, 128"):
    _small_cfg(chunk_size=chunk)


def test_one_named_implementation_raises_its_own_error():
  """Off TPU without interpret mode the Pallas kernels raise
  NotImplementedError, caught by `except NotImplementedError` (not an
  ExceptionGroup of one)."""
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  if config.on_tpu():
    pytest.skip("on a TPU the kernels run")
  cfg = _small_cfg()
  params = init_params(jax.random.key(0), cfg)
  x = jnp.ones((1, 4, cfg.hidden_size))
  with config.interpret_mode(False):
    with pytest.raises(NotImplementedError) as info:
      gated_deltanet(params, x, cfg, implementation="pallas_mosaic_tpu")
  assert not isinstance(info.value, ExceptionGroup)


def test_bf16_runs_finite():
  cfg = _small_cfg()
  params = init_params(jax.random.key(0), cfg, dtype=jnp.bfloat16)
  x = jax.random.normal(jax.random.key(1), (1, 9, cfg.hidden_size), jnp.bfloat16)
  run = layer(cfg, "xla")
  y = run(params, x)
  y32 = run(jax.tree.map(lambda p: p.astype(jnp.float32), params), x.astype(jnp.float32))
  assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y)))
  assert rel_rms(y, y32) < 5e-2


def test_from_hf_config():
  hf = dict(hidden_size=2048, linear_num_key_heads=16, linear_num_value_heads=32,
            linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6, num_hidden_layers=48)
  cfg = GatedDeltaNetConfig.from_hf_config(hf, variant="qwen3_next")
  assert (cfg.hidden_size, cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim,
          cfg.conv_kernel_size, cfg.rms_norm_eps, cfg.variant) == (
              2048, 16, 32, 128, 128, 4, 1e-6, "qwen3_next")
  assert cfg.conv_dim == 8192
  nested = GatedDeltaNetConfig.from_hf_config({"text_config": hf}, variant="qwen3_5")
  assert nested == dataclasses.replace(cfg, variant="qwen3_5")
  with pytest.raises(ValueError, match="variant"):
    GatedDeltaNetConfig.from_hf_config(hf, variant="mamba")
  with pytest.raises(ValueError, match="variant"):
    GatedDeltaNetConfig.from_hf_config(hf)      # no model_type to go by
  assert GatedDeltaNetConfig.from_hf_config(dict(hf, model_type="qwen3_next")) == cfg
  assert GatedDeltaNetConfig.from_hf_config(
      {"model_type": "qwen3_5_moe", "text_config": hf}).variant == "qwen3_5"
  with pytest.raises(ValueError, match="num_v_heads"):
    GatedDeltaNetConfig(hidden_size=8, num_k_heads=3, num_v_heads=4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_hf_weight_round_trip(variant):
  _, cfg, sd = load_fixture(variant)
  params = params_from_hf(sd, cfg)
  assert {k: v.shape for k, v in params.items()} == param_shapes(cfg)
  back = params_to_hf(params, cfg)
  assert set(back) == set(sd)
  for k in sd:
    np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
  # One layer's keys under their checkpoint prefix load the same.
  prefixed = {f"model.layers.0.linear_attn.{k}": v for k, v in sd.items()}
  again = params_from_hf(prefixed, cfg)
  for k in params:
    np.testing.assert_array_equal(again[k], params[k])
  with pytest.raises(KeyError):
    params_from_hf({}, cfg)


def _two_layers(sd):
  """Layer 0 = the fixture, layer 1 = its negation, plus a non-linear_attn key."""
  both = {f"model.layers.{i}.linear_attn.{k}": (v if i == 0 else -v)
          for i in (0, 1) for k, v in sd.items()}
  both["model.layers.0.input_layernorm.weight"] = np.ones(3, np.float32)
  return both


def test_params_from_hf_prefix_and_bad_keys():
  """Two layers' keys need `prefix=` (before: the last layer won silently); a
  misspelt name is an error naming it (before: ignored)."""
  _, cfg, sd = load_fixture("qwen3_next")
  params = params_from_hf(sd, cfg)
  both = _two_layers(sd)
  with pytest.raises(ValueError, match="more than one layer"):
    params_from_hf({k: v for k, v in both.items() if "linear_attn" in k}, cfg)
  for i, sign in ((0, 1), (1, -1)):
    got = params_from_hf(both, cfg, prefix=f"model.layers.{i}.linear_attn.")
    for k in params:
      np.testing.assert_array_equal(got[k], sign * params[k], err_msg=k)
  typo = dict(sd)
  typo["norm.weigth"] = typo.pop("norm.weight")
  with pytest.raises(ValueError, match="norm.weigth"):
    params_from_hf(typo, cfg)
  with pytest.raises(ValueError, match="conv1d.bias"):
    params_from_hf(dict(sd, **{"conv1d.bias": np.zeros(cfg.conv_dim)}), cfg)
  with pytest.raises(ValueError, match="in_proj_qkv.weight"):     # a Qwen3.5 name in Qwen3-Next
    params_from_hf(dict(sd, **{"in_proj_qkv.weight": sd["in_proj_qkvz.weight"]}), cfg)
  with pytest.raises(ValueError, match="prefix"):
    params_from_hf(both, cfg, prefix="model.layers.7.linear_attn.")


def test_docs_checkpoint_block(tmp_path, monkeypatch):
  """Runs docs/models.md's checkpoint-loading block, as written (it is fenced
  `{skip}` there: it needs a checkpoint), on a sharded two-layer safetensors
  checkpoint written here (tiny config, HF's file layout)."""
  from safetensors import numpy as safetensors_numpy  # pylint: disable=g-import-not-at-top
  d, cfg_fixture, sd = load_fixture("qwen3_next")
  params = params_from_hf(sd, cfg_fixture)
  hf_config = dict(json.loads(str(d["hf_config"])), model_type="qwen3_next")
  del hf_config["variant"]
  ckpt = tmp_path / "Qwen3-Next-80B-A3B-Instruct"
  ckpt.mkdir()
  (ckpt / "config.json").write_text(json.dumps(hf_config))
  both = {k: v.astype(np.float32) for k, v in _two_layers(sd).items()}
  names = sorted(both)
  shards = {f"model-0000{i + 1}-of-00002.safetensors": names[i::2] for i in range(2)}
  for fn, keys in shards.items():
    safetensors_numpy.save_file({k: both[k] for k in keys}, str(ckpt / fn))
  (ckpt / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {k: fn for fn, keys in shards.items() for k in keys}}))
  monkeypatch.chdir(tmp_path)
  scope = {"__name__": "__main__"}
  exec(doc_blocks.block("load_hf_layer(").code, scope)  # pylint: disable=exec-used
  for k, v in scope["params"].items():
    want = params[k] if k in ("a_log", "dt_bias") else params[k].astype(jnp.bfloat16)
    np.testing.assert_array_equal(v, want, err_msg=k)
    assert v.dtype == want.dtype, k
  assert scope["y"].shape == scope["x"].shape
  assert np.isfinite(np.asarray(scope["y"], np.float32)).all()
  # A single .safetensors file (layer 1 of it) loads too.
  from tokamax_gdn.layers import load_hf_layer  # pylint: disable=g-import-not-at-top
  safetensors_numpy.save_file(both, str(tmp_path / "one.safetensors"))
  one = load_hf_layer(str(tmp_path / "one.safetensors"), scope["cfg"],
                      prefix="model.layers.1.linear_attn.")
  for k in params:
    np.testing.assert_array_equal(one[k], -params[k], err_msg=k)


def test_qwen3_next_and_qwen3_5_layouts_agree():
  """The same layer stored both ways: Qwen3-Next's interleaving is only a layout."""
  _, cfg, sd = load_fixture("qwen3_next")
  params = params_from_hf(sd, cfg)
  cfg35 = dataclasses.replace(cfg, variant="qwen3_5")
  sd35 = params_to_hf(params, cfg35)
  assert "in_proj_qkv.weight" in sd35 and "in_proj_qkvz.weight" not in sd35
  for k, v in params_from_hf(sd35, cfg35).items():
    np.testing.assert_array_equal(v, params[k])


def test_presets():
  names = list_presets()
  for n in ("qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "qwen3.5-397b-a17b", "qwen3.5-tiny"):
    assert n in names
  tiny = load_preset("qwen3.5-tiny")
  assert (tiny.hidden_size, tiny.num_k_heads, tiny.num_v_heads, tiny.head_k_dim,
          tiny.head_v_dim, tiny.conv_kernel_size, tiny.chunk_size, tiny.use_gdn_kernel) == (
              1024, 16, 32, 128, 128, 4, None, True)
  assert load_preset("qwen3.5-397b-a17b").num_v_heads == 64
  assert load_preset("qwen3-next-80b-a3b").variant == "qwen3_next"
  with pytest.raises(ValueError, match="qwen3.5-tiny"):
    load_preset("nope")


def test_init_params_shapes():
  cfg = load_preset("qwen3.5-tiny")
  shapes = jax.eval_shape(lambda k: init_params(k, cfg), jax.random.key(0))
  assert {k: v.shape for k, v in shapes.items()} == param_shapes(cfg)
  assert shapes["in_proj"].shape == (1024, 8192 + 4096 + 64)


def _gated_rmsnorm_by_autodiff(o, z, weight, eps):
  """The gated RMSNorm's forward as plain jnp, differentiated by autodiff."""
  o32 = o.astype(jnp.float32)
  o32 = o32 * jax.lax.rsqrt(jnp.mean(o32 * o32, axis=-1, keepdims=True) + eps)
  h = weight * o32.astype(o.dtype)
  return (h.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(o.dtype)


@pytest.mark.parametrize("dtype,weight_dtype,tol", [
    (jnp.float32, jnp.float32, 1e-5), (jnp.bfloat16, jnp.bfloat16, 2e-2),
    (jnp.bfloat16, jnp.float32, 2e-2)])
def test_gated_rmsnorm_vjp_matches_autodiff(dtype, weight_dtype, tol):
  from tokamax_gdn.layers import gated_rmsnorm  # pylint: disable=g-import-not-at-top
  ko, kz, kw, kc = jax.random.split(jax.random.key(3), 4)
  o = jax.random.normal(ko, (2, 5, 3, 16)).astype(dtype)
  z = jax.random.normal(kz, (2, 5, 3, 16)).astype(dtype)
  w = (1.0 + 0.3 * jax.random.normal(kw, (16,))).astype(weight_dtype)
  cot = jax.random.normal(kc, o.shape).astype(dtype)
  got, got_vjp = jax.vjp(lambda *a: gated_rmsnorm(*a, 1e-6), o, z, w)
  want, want_vjp = jax.vjp(lambda *a: _gated_rmsnorm_by_autodiff(*a, 1e-6), o, z, w)
  assert got.dtype == want.dtype == dtype
  np.testing.assert_array_equal(got, want)       # the forward is the same computation
  for g, w_, name in zip(got_vjp(cot), want_vjp(cot), ("o", "z", "weight")):
    assert g.dtype == w_.dtype, name
    assert rel_rms(g, w_) < tol, name


def _aligned_cfg():
  """q, k and v each span a whole 128-lane tile: `conv_groups` splits them."""
  return GatedDeltaNetConfig(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=128,
                             head_v_dim=64, conv_kernel_size=4)


def _layer_by_one_projection(params, x, cfg, cache=None):
  """The layer as its module docstring writes it: one in-projection matmul,
  one conv over [q k v], reference GDN; returns (y, cache)."""
  from tokamax_gdn import causal_conv1d, gated_delta_rule  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.layers.gated_deltanet import in_projection, out_projection  # pylint: disable=g-import-not-at-top
  b, t, _ = x.shape
  qkv, z, beta, a = in_projection(params, x, cfg)
  qkv, conv_state = causal_conv1d(qkv, params["conv_weight"], None, activation="silu",
                                  initial_state=None if cache is None else cache.conv_state,
                                  output_final_state=True, implementation="reference")
  kd = cfg.key_dim
  q = qkv[..., :kd].reshape(b, t, cfg.num_k_heads, cfg.head_k_dim)
  k = qkv[..., kd:2 * kd].reshape(b, t, cfg.num_k_heads, cfg.head_k_dim)
  v = qkv[..., 2 * kd:].reshape(b, t, cfg.num_v_heads, cfg.head_v_dim)
  o, state = gated_delta_rule(q, k, v, a, jax.nn.sigmoid(beta), use_qk_l2norm=True,
                              a_log=params["a_log"], dt_bias=params["dt_bias"],
                              initial_state=None if cache is None else cache.recurrent_state,
                              output_final_state=True, implementation="reference")
  return out_projection(params, o, z, cfg), GatedDeltaNetCache(conv_state, state)


def test_conv_groups_split_aligned_channels_only():
  from tokamax_gdn.layers.gated_deltanet import conv_groups  # pylint: disable=g-import-not-at-top
  assert conv_groups(_aligned_cfg()) == (0, 128, 256, 384)
  assert conv_groups(_small_cfg()) == (0, _small_cfg().conv_dim)


def test_split_projection_layer_matches_one_projection():
  """The layer on q | k | v channel groups (`conv_groups`): forward, cache and
  every gradient (params, x, the incoming cache) as the one-projection
  formula's, both from a given cache."""
  cfg = _aligned_cfg()
  params = init_params(jax.random.key(0), cfg)
  kx, kc, ks, kr = jax.random.split(jax.random.key(1), 4)
  x = jax.random.normal(kx, (2, 9, cfg.hidden_size))
  cache = GatedDeltaNetCache(
      jax.random.normal(ks, (2, cfg.conv_kernel_size - 1, cfg.conv_dim)),
      0.1 * jax.random.normal(kr, (2, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim)))
  cot = jax.random.normal(kc, x.shape)

  def loss(f):
    def run(params, x, cache):
      y, new = f(params, x, cache)
      return jnp.sum(y * cot) + jnp.sum(new.conv_state) + jnp.sum(new.recurrent_state ** 2), (y, new)
    return jax.jit(jax.grad(run, argnums=(0, 1, 2), has_aux=True))

  got_grads, (got_y, got_cache) = loss(lambda p, x, c: gated_deltanet(
      p, x, cfg, implementation="reference", cache=c, return_cache=True))(params, x, cache)
  want_grads, (want_y, want_cache) = loss(lambda p, x, c: _layer_by_one_projection(
      p, x, cfg, c))(params, x, cache)
  assert rel_rms(got_y, want_y) < 1e-5
  for a, b in zip(got_cache, want_cache):
    assert rel_rms(a, b) < 1e-5
  want_leaves = jax.tree.leaves(want_grads)
  for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got_grads), want_leaves):
    assert rel_rms(g, w) < 1e-4, jax.tree_util.keystr(path)
