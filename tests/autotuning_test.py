"""Autotuning end to end: discovery by `tokamax.autotune`, JSON round trip,
context-manager overlay, the package's shipped cache (hit, miss, precedence),
`tokamax-gdn autotune`, and a wheel install that ships the tuning data."""

import argparse
import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import pytest
import tokamax
from tokamax._src import benchmarking
from tokamax._src import hlo_utils
from tokamax._src.autotuning import autotuner
from tokamax._src.ops import op as op_lib

import tokamax_gdn
from tokamax_gdn import autotuning
from tokamax_gdn import cli
from tokamax_gdn import layers
from tokamax_gdn import registry
from tokamax_gdn.benchmarks import autotune as tune
from tokamax_gdn.benchmarks import workload
from tokamax_gdn.cli import common

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = workload.LayerShape(b=1, t=32, hk=1, hv=2, k=16, v=16, dtype=jnp.float32)
# The shape of the shipped CPU data (see the README's "Autotuning").
SHIPPED = workload.LayerShape(b=1, t=8192, hk=2, hv=4, k=128, v=128, dtype=jnp.bfloat16)
DEVICE_KIND = jax.devices()[0].device_kind


def _xla_config(chunk_size):
  return type(registry.get("gated_delta_rule", "xla")).config_cls(chunk_size=chunk_size)


def _inputs(shapes):
  specs = workload.abstract_inputs(shapes)
  keys = jax.random.split(jax.random.PRNGKey(0), len(specs))
  return tuple((0.3 * jax.random.normal(k, s.shape, jnp.float32)).astype(s.dtype)
               for k, s in zip(keys, specs))


def _forward(q, k, v, g, beta, a_log, dt_bias):
  return tokamax_gdn.gated_delta_rule(
      q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias, use_qk_l2norm=True,
      implementation="xla")[0]


def _loss(*xs):
  return jnp.sum(_forward(*xs).astype(jnp.float32))


_grad = jax.grad(_loss, argnums=tuple(range(7)))


def _bench(ms):
  return benchmarking.BenchmarkData(
      compile_time_ms=1.0, lower_time_ms=1.0, evaluation_times_ms=(ms,), metadata={})


def _fake_result(bound, best):
  """`best` measured faster than the heuristics config for every bound op."""
  data = tuple(
      (ba, autotuner.AutotuningData({ba.heuristics_config: _bench(1.0), best: _bench(0.5)}))
      for ba in bound)
  return tokamax.AutotuningResult(DEVICE_KIND, data)


def _bound(shapes, impl="xla"):
  return [ba for _, ba in tune.bound_args("gated_delta_rule", impl, shapes)]


@pytest.fixture(scope="module")
def grad_result():
  return tokamax.autotune(_grad, *_inputs(TINY), ignore_cache=True, progress_bar=False)


@pytest.fixture
def extra_dir(tmp_path, monkeypatch):
  """An extra shipped-data root, read after the package's; caches reloaded."""
  monkeypatch.setenv(autotuning.ENV_DIRS, str(tmp_path))
  autotuning.reload()
  yield tmp_path
  autotuning.reload()


def test_autotune_discovers_forward_op():
  result = tokamax.autotune(_forward, *_inputs(TINY), ignore_cache=True, progress_bar=False)
  assert [type(ba.op).__name__ for ba, _ in result.data] == ["XlaGatedDeltaRule"]
  (ba, data), = result.data
  assert not ba.arguments["return_residuals"]
  assert set(data) == ba.autotuning_configs
  assert {c.chunk_size for c in data} == {16, 32, 64, 128}
  assert data.fastest_config in ba.autotuning_configs


def test_autotune_discovers_vjp_op_under_grad(grad_result):
  assert grad_result.device_kind == DEVICE_KIND
  names = sorted(type(ba.op).__name__ for ba, _ in grad_result.data)
  assert names == ["XlaGatedDeltaRule", "XlaGatedDeltaRuleVjp"]
  for ba, data in grad_result.data:
    assert set(data) == ba.autotuning_configs, type(ba.op).__name__
    assert all(isinstance(b, benchmarking.BenchmarkData) for b in data.values())


def test_json_round_trip(grad_result):
  text = grad_result.dumps()
  back = tokamax.AutotuningResult.loads(text)
  assert back.device_kind == grad_result.device_kind
  summary = lambda r: [(type(ba.op), ba.autotuning_cache_key, d.fastest_config, dict(d))
                       for ba, d in r.data]
  assert summary(back) == summary(grad_result)
  assert back.dumps() == text


def test_result_as_context_manager_sets_default_config(grad_result):
  bound = _bound(TINY)
  heuristics = [ba.default_config for ba in bound]
  assert heuristics == [ba.heuristics_config for ba in bound]
  best = _xla_config(128)
  assert best not in heuristics
  fake = tokamax.AutotuningResult.loads(_fake_result(bound, best).dumps())
  with fake:
    assert [ba.default_config for ba in bound] == [best] * len(bound)
    out = jax.jit(_forward)(*_inputs(TINY))  # traced (and run) with the overlaid config
  assert [ba.default_config for ba in bound] == heuristics
  assert jnp.all(jnp.isfinite(out))
  # The measured result overlays the same way.
  with grad_result:
    for ba, data in grad_result.data:
      assert ba.default_config == data.fastest_config


def test_shipped_cache_hit_and_miss(extra_dir):
  bound = _bound(TINY)
  best = _xla_config(128)
  written = autotuning.install(_fake_result(bound, best), extra_dir)
  kind = autotuning.normalize_device_kind(DEVICE_KIND)
  assert sorted(p.relative_to(extra_dir).as_posix() for p in written) == [
      f"{kind}/xla_gated_delta_rule.json", f"{kind}/xla_gated_delta_rule_vjp.json"]
  for ba in bound:  # fwd, fwd inside grad (return_residuals) and vjp
    assert ba.cached_autotuning_data is not None, type(ba.op).__name__
    assert ba.default_config == best
  miss = _bound(dataclasses.replace(TINY, t=48))
  for ba in miss:
    assert ba.cached_autotuning_data is None
    assert ba.default_config == ba.heuristics_config
  with tokamax.config.autotuning_cache_miss_fallback("error"):
    assert bound[0].default_config == best
    with pytest.raises(ValueError, match="No config found"):
      _ = miss[0].default_config


def test_install_merges_and_replaces(extra_dir):
  bound, other = _bound(TINY), _bound(dataclasses.replace(TINY, t=48))
  autotuning.install(_fake_result(bound, _xla_config(128)), extra_dir)
  autotuning.install(_fake_result(other, _xla_config(16)), extra_dir)
  autotuning.install(_fake_result(bound[:1], _xla_config(64)), extra_dir)
  assert bound[0].default_config == _xla_config(64)
  assert [ba.default_config for ba in bound[1:]] == [_xla_config(128)] * 2
  assert [ba.default_config for ba in other] == [_xla_config(16)] * 3
  text = (extra_dir / autotuning.normalize_device_kind(DEVICE_KIND)
          / "xla_gated_delta_rule.json").read_text()
  assert len(json.loads(text)) == 4  # T=32, T=48: alone and inside grad


def test_tokamax_cache_entries_win_over_shipped(extra_dir):
  ba = _bound(TINY)[0]
  autotuning.install(_fake_result([ba], _xla_config(128)), extra_dir)
  op = ba.op.replace(vjp=None)
  own = autotuner.AutotuningData({_xla_config(16): _bench(0.1)})
  op_lib._AUTOTUNING_CACHE[op] = {DEVICE_KIND: {ba.autotuning_cache_key: own}}  # pylint: disable=protected-access
  assert ba.default_config == _xla_config(16)


def test_ignore_autotuning_cache_ignores_shipped(extra_dir):
  ba = _bound(TINY)[0]
  autotuning.install(_fake_result([ba], _xla_config(128)), extra_dir)
  with tokamax.config.ignore_autotuning_cache(True):
    assert ba.default_config == ba.heuristics_config
  assert ba.default_config == _xla_config(128)


def test_shipped_cpu_data_matches_its_shape():
  autotuning.reload()
  names = {p.name for p in autotuning.shipped_files("cpu")}
  assert {"xla_gated_delta_rule.json", "xla_gated_delta_rule_vjp.json"} <= names
  for label, ba in tune.bound_args("gated_delta_rule", "xla", SHIPPED):
    data = ba.op.get_autotuning_cache("cpu").get(ba.autotuning_cache_key)
    assert data is not None, label
    if DEVICE_KIND == "cpu":
      assert ba.default_config == data.fastest_config


def test_cli_out_and_install(tmp_path, extra_dir, capsys):
  out = tmp_path / "result.json"
  rc = cli.main(["autotune", "--hk", "1", "--hv", "2", "--k", "16", "--v", "16", "-T", "16",
                 "--dtype", "float32", "--forward-only", "--no-progress",
                 "--out", str(out), "--install", "--install-dir", str(extra_dir), "--json"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  (row,) = report["rows"]
  assert row["op"] == "gated_delta_rule" and row["implementation"] == "xla"
  assert row["speedup"] >= 1.0
  result = tokamax.AutotuningResult.loads(out.read_text())
  (ba, data), = result.data
  assert ba.default_config == data.fastest_config  # installed: read back from extra_dir
  capsys.readouterr()
  assert cli.main(["autotune", "-T", "16"]) == 2  # no model and no head shapes
  assert "give --model or all of --hk --hv --k --v" in capsys.readouterr().err


def test_cli_only_restricts_the_configs_timed(capsys):
  rc = cli.main(["autotune", "--hk", "1", "--hv", "2", "--k", "16", "--v", "16", "-T", "16",
                 "--dtype", "float32", "--forward-only", "--no-progress", "--json",
                 "--only", "chunk_size=16,32"])
  assert rc == 0
  (row,) = json.loads(capsys.readouterr().out)["rows"]
  shape = workload.LayerShape(b=1, t=16, hk=1, hv=2, k=16, v=16, dtype=jnp.float32)
  ((_, ba),) = tune.bound_args("gated_delta_rule", "xla", shape, backward=False)
  timed = {c for c in ba.autotuning_configs
           if c.chunk_size in (16, 32) or c == ba.heuristics_config}
  assert len(timed) < len(ba.autotuning_configs)
  assert set(row["all_ms"]) == {tune.config_str(c) for c in timed}


def test_config_filter_rejects_bad_terms():
  cfg = _xla_config(16)
  assert tune.config_filter([]) is None
  assert tune.config_filter(["chunk_size=16, 64"])(cfg)
  assert not tune.config_filter(["chunk_size=64"])(cfg)
  with pytest.raises(ValueError, match="FIELD=V1,V2"):
    tune.config_filter(["chunk_size"])
  with pytest.raises(ValueError, match="no field 'chunk'"):
    tune.config_filter(["chunk=16"])(cfg)


def test_cli_shapes_from_model_preset(tmp_path):
  parser = argparse.ArgumentParser()
  common.add_gdn_shape_args(parser, model_default=None, seq_len_default=None)
  parse = lambda *a: common.gdn_shape(parser.parse_args(list(a)))
  s = parse("--model", str(REPO / "configs/models/qwen3.5-tiny.yml"), "-T", "64", "--hk", "2")
  assert (s.b, s.t, s.hk, s.hv, s.k, s.v) == (1, 64, 2, 32, 128, 128)
  assert s.dtype == jnp.bfloat16
  elsewhere = tmp_path / "configs/models/qwen3.5-tiny.yml"  # not a file: the preset
  assert parse("--model", str(elsewhere), "-T", "64", "--dtype", "float32") == (
      workload.LayerShape(b=1, t=64, hk=16, hv=32, k=128, v=128, dtype=jnp.float32))
  with pytest.raises(ValueError, match="no-such-model"):
    parse("--model", "no-such-model", "-T", "64")


def test_pallas_interpret_autotune_mechanism(monkeypatch):
  impls = registry.implementations("gated_delta_rule")
  assert "pallas_mosaic_tpu" in impls, "the Pallas GDN is not registered"
  assert type(impls["pallas_mosaic_tpu"]).config_cls is not op_lib.NullConfig, (
      "the Pallas GDN has no Config to tune")
  # The environment variable, not the thread-local switch: tokamax may compile
  # configs on worker threads.
  monkeypatch.setenv("TOKAMAX_GDN_INTERPRET", "1")
  shapes = workload.LayerShape(b=1, t=64, hk=1, hv=1, k=128, v=128, dtype=jnp.float32)
  items = tune.bound_args("gated_delta_rule", "pallas_mosaic_tpu", shapes, backward=False)
  assert items, "pallas_mosaic_tpu op not found in the lowered function"
  ba = items[0][1]
  configs = set(sorted(ba.autotuning_configs, key=str)[:2])
  data = ba.autotune(configs, cache_results=False)
  assert data.fastest_config in configs


def test_shipped_v5e_data_matches_the_qwen3_next_layer(monkeypatch):
  """The Pallas GDN's data tuned on a TPU v5e (`tokamax-gdn autotune --model
  qwen3-next-80b-a3b --seq-len 4096 --impl pallas_mosaic_tpu`, on the chip)
  holds the keys the layer looks up there, forward and VJP."""
  monkeypatch.setenv("TOKAMAX_GDN_INTERPRET", "1")
  monkeypatch.setenv("TOKAMAX_GDN_TARGET_CHIP", "v5e")
  autotuning.reload()
  kind = "TPU v5 lite"
  names = {p.name for p in autotuning.shipped_files(kind)}
  assert {"pallas_mosaic_tpu_gated_delta_rule.json",
          "pallas_mosaic_tpu_gated_delta_rule_vjp.json"} <= names
  shapes = workload.LayerShape(b=1, t=4096, hk=16, hv=32, k=128, v=128, dtype=jnp.bfloat16)
  items = tune.bound_args("gated_delta_rule", "pallas_mosaic_tpu", shapes)
  assert [label for label, _ in items] == ["fwd", "fwd (in grad)", "vjp"]
  for label, ba in items:
    data = ba.op.get_autotuning_cache(kind).get(ba.autotuning_cache_key)
    assert data is not None, label
    assert data.fastest_config.chunk_size == 128, (label, data.fastest_config)
    assert data.fastest_config in ba.autotuning_configs, label


def test_layer_looks_up_the_keys_autotune_tunes():
  """`GatedDeltaNet` makes exactly the GDN calls `tokamax-gdn autotune` tunes and,
  with chunk_size=None, leaves the config to the cache; a chunk size pins it."""
  cfg = layers.GatedDeltaNetConfig(hidden_size=32, num_k_heads=1, num_v_heads=2,
                                  head_k_dim=16, head_v_dim=16, use_gdn_kernel=False)
  params = layers.init_params(jax.random.PRNGKey(0), cfg, jnp.bfloat16)
  x = jnp.ones((1, 40, 32), jnp.bfloat16)

  def gdn_bound(cfg):
    fwd = lambda p, x: layers.gated_deltanet(p, x, cfg, implementation="xla")
    grad = jax.grad(lambda p, x: jnp.sum(fwd(p, x).astype(jnp.float32)))
    found = [*hlo_utils.get_bound_args(fwd, params, x),
             *hlo_utils.get_bound_args(grad, params, x)]
    return [ba for ba in found if "GatedDeltaRule" in type(ba.op).__name__]

  shapes = workload.LayerShape(b=1, t=40, hk=1, hv=2, k=16, v=16, dtype=jnp.bfloat16)
  tuned = {ba.autotuning_cache_key for _, ba in tune.bound_args("gated_delta_rule", "xla", shapes)}
  used = gdn_bound(cfg)
  assert {ba.autotuning_cache_key for ba in used} == tuned
  # (get_bound_args drops configs, so look at what the layer passes the op.)
  from tokamax_gdn.layers.gated_deltanet import _implementations  # pylint: disable=g-import-not-at-top,protected-access
  # One named implementation stays one name (or one Op), not a sequence.
  assert _implementations("gated_delta_rule", "xla", cfg) == "xla"
  pinned = _implementations("gated_delta_rule", "xla", dataclasses.replace(cfg, chunk_size=32))
  assert pinned.config.chunk_size == 32 and pinned.vjp.config.chunk_size == 32


def test_vjp_cache_key_ignores_how_the_forward_tiled():
  """Tuning the forward (which changes the saved residuals) keeps the VJP's entries."""
  xla_op = registry.get("gated_delta_rule", "xla")
  args = _inputs(dataclasses.replace(TINY, t=700))
  keys = []
  for block in (256, 512, 2048):
    cfg = type(_xla_config(32))(chunk_size=32, block_size=block)
    op = xla_op.replace(config=cfg)
    fn = jax.grad(lambda *xs: jnp.sum(op(*xs[:5], a_log=xs[5], dt_bias=xs[6],
                                         use_qk_l2norm=True)[0]), argnums=range(7))
    (vjp_ba,) = [ba for ba in hlo_utils.get_bound_args(fn, *args)
                 if type(ba.op).__name__.endswith("Vjp")]
    states = vjp_ba.arguments["residuals"].states
    assert (states is None) == (block == 2048)
    keys.append(vjp_ba.autotuning_cache_key)
  assert keys[0] == keys[1] == keys[2]
