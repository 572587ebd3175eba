"""`tokamax-gdn bench --op generate` (`benchmarks/generation.py`), on CPU at a
two-block model: the rows' arithmetic against a floor computed here from the
config, failures as rows, the GDN attribution of a profile, and the command
on a (pretended) TPU and off it."""

import json

import jax
import jax.numpy as jnp
import pytest

from tokamax_gdn import cli
from tokamax_gdn import models
from tokamax_gdn.benchmarks import generation
from tokamax_gdn.benchmarks import timing
from tokamax_gdn.training import step_split

FLOORS = timing.Floors("cpu", "v5e", mxu_flops=1e11, hbm_bytes=1e10, peak_flops=197e12,
                       peak_hbm=819e9)
PROMPT, N = 4, 2


def _cfg():
  """qwen3.5-micro cut to one GDN block and one attention block: the
  smallest model with both kinds (compiles in seconds on CPU)."""
  return models.ModelConfig.load("qwen3.5-micro").replace(num_layers=2,
                                                          full_attention_interval=2)


def _decode_bytes(cfg, batch, kv_positions):
  """The decode floor's bytes from the config alone (bf16 weights, f32 router
  and GDN gate parameters, bf16 conv pools and KV cache, f32 recurrent
  pools); see the module docstring of `benchmarks/generation.py`."""
  g, h, bf16, f32 = cfg.gdn, cfg.hidden_size, 2, 4
  e, k, i = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
  experts_used = min(e, batch * k)
  moe = h * e * f32 + 3 * experts_used * h * i * bf16            # router + used experts
  norms = 2 * h * bf16
  in_proj = h * (2 * g.num_k_heads * g.head_k_dim + 2 * g.num_v_heads * g.head_v_dim
                 + 2 * g.num_v_heads)
  conv_dim = 2 * g.num_k_heads * g.head_k_dim + g.num_v_heads * g.head_v_dim
  gdn = ((in_proj + conv_dim * g.conv_kernel_size + g.head_v_dim
          + g.num_v_heads * g.head_v_dim * h) * bf16 + 2 * g.num_v_heads * f32)
  d, heads, kvh = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
  attn = (2 * h * heads * d + 2 * h * kvh * d + 2 * d) * bf16
  n_attn = cfg.num_periods
  n_gdn = cfg.num_layers - n_attn
  weights = (n_gdn * (gdn + moe + norms) + n_attn * (attn + moe + norms)
             + batch * h * bf16 + h * cfg.vocab_size * bf16 + h * bf16)  # embed rows, head, norm
  states = n_gdn * batch * 2 * (g.num_v_heads * g.head_k_dim * g.head_v_dim * f32
                                + (g.conv_kernel_size - 1) * conv_dim * bf16)
  kv = n_attn * batch * 2 * kv_positions * kvh * d * bf16
  return weights + states + kv


def test_rows_arithmetic_floor_and_failures_as_rows():
  cfg = _cfg()
  lines = []
  rows = generation.generation_rows(FLOORS, cfg, batches=(1, 3), prompt_len=PROMPT,
                                    impls=("pallas_mosaic_tpu", "reference"), n=N,
                                    profiled=True, log=lines.append)
  assert [(r["impl"], r["batch"], r["phase"]) for r in rows] == [
      (impl, b, phase) for impl in ("pallas_mosaic_tpu", "reference") for b in (1, 3)
      for phase in ("prefill", "decode")]
  assert len(lines) == 2 * len(rows) and lines[0].endswith("compiling")
  for r in rows[:4]:       # no Pallas on CPU: a row with the reason, and the others run
    assert r["ms"] is None and "PallasTpuUnavailableError" in r["error"], r["error"]
    assert "needs a TPU" in r["error"]
  for r in rows[4:]:
    assert "error" not in r and r["ms"] > 0 and r["compile_s"] > 0
    b = r["batch"]
    assert r["tokens"] == (b * PROMPT if r["phase"] == "prefill" else b)
    assert r["tokens_per_s"] == pytest.approx(r["tokens"] / (r["ms"] / 1e3))
    # Off a TPU the profile has no device track: no device time, no share.
    assert r.get("device_ms") is None and r.get("gdn_share") is None
    if r["phase"] == "prefill":
      assert r.get("floor_ms") is None
      continue
    # Timed decode call i attends over PROMPT + WARM + i + 1 positions; the
    # steady state is the slope between bursts over calls [0, N) and [N, 3N):
    # for a cost linear in i, the cost at i = (Σ_{N..3N-1} i - Σ_{0..N-1} i) / N.
    index = (sum(range(N, 3 * N)) - sum(range(N))) / N
    kv_positions = PROMPT + generation.WARM + index + 1
    assert r["kv_positions"] == kv_positions
    assert r["hbm_bytes"] == pytest.approx(_decode_bytes(cfg, b, kv_positions))
    assert r["hbm_bytes"] == pytest.approx(r["weight_bytes"] + r["state_bytes"] + r["kv_bytes"])
    assert r["floor_ms"] == pytest.approx(r["hbm_bytes"] / FLOORS.hbm_bytes * 1e3)
    assert r["over_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
  # Batch 1 routes to top_k of the experts, batch 3 can reach all of them.
  decode = {r["batch"]: r for r in rows[4:] if r["phase"] == "decode"}
  assert decode[1]["weight_bytes"] < decode[3]["weight_bytes"]


def test_the_serving_ops_instructions_are_gdn_in_the_split():
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs  # pylint: disable=g-import-not-at-top
  import tokamax_gdn  # pylint: disable=g-import-not-at-top
  args, kwargs = arg_specs.by_name("tiny_decode_8_ctx").make(jax.random.key(0))

  def f(x, *args):
    _, out = tokamax_gdn.causal_conv1d_gated_delta_rule(*args, **kwargs, implementation="reference")
    return jnp.cos(x) * 3.0, out

  text = jax.jit(f).lower(jnp.ones((8, 8)), *args).compile().as_text()
  instructions = step_split.parse_hlo(text)
  gdn = {n for n, ins in instructions.items()
         if step_split.classify_instruction(ins) == step_split.GDN}
  assert gdn and all(f"%{name} =" in text for name in gdn)
  cosine = [line for line in text.splitlines() if "cosine(" in line]
  assert cosine and not any(line.split("=")[0].strip().lstrip("%") in gdn for line in cosine)


def _trace(ops):
  """A device trace: a TPU process, its "XLA Ops" track and a host track."""
  meta = [dict(ph="M", name="process_name", pid=1, args=dict(name="/device:TPU:0")),
          dict(ph="M", name="thread_name", pid=1, tid=2, args=dict(name="XLA Ops")),
          dict(ph="M", name="thread_name", pid=1, tid=3, args=dict(name="XLA Modules")),
          dict(ph="M", name="process_name", pid=9, args=dict(name="/host:CPU"))]
  events = [dict(ph="X", pid=1, tid=2, ts=ts, dur=dur, name=name) for name, ts, dur in ops]
  events += [dict(ph="X", pid=1, tid=3, ts=0, dur=1000, name="jit__step"),
             dict(ph="X", pid=9, tid=1, ts=0, dur=500, name="fusion.1")]
  return meta + events


_SERVING = '"tokamax:{\\"op\\":{\\"__type\\":\\"tokamax_gdn.ops.causal_conv1d_gated_delta_rule.xla.X\\"}}"'
_HLO = "\n".join([
    f"%while.7 = f32[8]{{0}} while(%p), metadata={{metadata_payload={_SERVING}}}",
    f"%fusion.3 = f32[8]{{0}} fusion(%a), metadata={{metadata_payload={_SERVING}}}",
    f"%fusion.4 = f32[8]{{0}} fusion(%b), metadata={{metadata_payload={_SERVING}}}",
    "%fusion.9 = f32[8]{0} fusion(%c)",
])


def test_split_counts_nested_events_once_and_finds_kernels_by_name(monkeypatch):
  # A GDN loop (100 us) whose body shows as two events (30 + 20 us), a GDN
  # Pallas kernel named by its pallas_call, a matmul, and an unknown event.
  ops = [("while.7", 0, 100), ("fusion.3", 10, 30), ("fusion.4", 50, 20),
         ("gdn_serve_decode.1", 120, 40), ("fusion.9", 200, 60), ("mystery", 300, 10)]
  monkeypatch.setattr(generation.profile, "trace_events", lambda d: _trace(ops))
  split = generation._profile_split(lambda: None, _HLO, calls=2)  # pylint: disable=protected-access
  assert split["device_ms"] == pytest.approx(210 / 2 / 1e3)     # 100 + 40 + 60 + 10, per call
  assert split["gdn_ms"] == pytest.approx(140 / 2 / 1e3)
  assert split["matched"] == pytest.approx(200 / 210)
  # A profile whose loop bodies are not shown: the loop's own time is all GDN.
  monkeypatch.setattr(generation.profile, "trace_events",
                      lambda d: _trace([("while.7", 0, 100), ("fusion.9", 200, 60)]))
  split = generation._profile_split(lambda: None, _HLO, calls=1)  # pylint: disable=protected-access
  assert split["gdn_ms"] == pytest.approx(0.1) and split["device_ms"] == pytest.approx(0.16)
  monkeypatch.setattr(generation.profile, "trace_events", lambda d: _trace([]))
  assert generation._profile_split(lambda: None, _HLO) is None   # pylint: disable=protected-access


def _model_file(tmp_path):
  path = tmp_path / "two-block.yml"
  text = open("configs/models/qwen3.5-micro.yml").read()
  path.write_text(text.replace("name: qwen3.5-micro", "name: two-block")
                  .replace("num_layers: 4", "num_layers: 2")
                  .replace("full_attention_interval: 4", "full_attention_interval: 2"))
  return str(path)


def test_command_on_a_tpu_prints_and_writes_the_record(monkeypatch, tmp_path, capsys):
  monkeypatch.setattr(timing, "measure_floors", lambda *a, **k: FLOORS)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  path = tmp_path / "performance.md"
  code = cli.main(["bench", "--op", "generate", "--model", _model_file(tmp_path), "--batches",
                   "2", "--impls", "reference", "--prompt-len", "3", "--reps", "2",
                   "--record", str(path)])
  assert code == 0
  out = capsys.readouterr()
  assert "models.generate steps, two-block" in out.out and "CPU figures" not in out.out
  assert "[bench] generation reference B=2 decode: compiling" in out.err
  text = path.read_text()
  assert "<!-- BEGIN chip-generation -->" in text
  assert "| reference | 2 | prefill | 6 |" in text and "| reference | 2 | decode | 2 |" in text


def test_command_off_a_tpu_says_cpu_figures_and_records_nothing(monkeypatch, tmp_path, capsys):
  seen = {}

  def rows(floors, cfg, **kw):
    seen.update(kw, model=cfg.name)
    return [dict(table="generation", impl="xla", batch=1, phase="decode", tokens=1, ms=2.0,
                 tokens_per_s=500.0, floor_ms=0.5, over_floor=4.0)]

  monkeypatch.setattr(generation, "generation_rows", rows)
  monkeypatch.setattr(timing, "measure_floors", lambda *a, **k: FLOORS)
  path = tmp_path / "performance.md"
  assert cli.main(["bench", "--op", "generate", "--record", str(path)]) == 0
  out = capsys.readouterr()
  assert "CPU figures, not the chip's" in out.out and "not written" in out.err
  assert not path.exists()
  assert seen["model"] == "qwen3.5-tiny" and seen["impls"] == ["xla"]
  assert seen["batches"] == [1, 8] and seen["prompt_len"] == 16
  assert cli.main(["bench", "--op", "generate", "--json"]) == 0
  assert json.loads(capsys.readouterr().out)["on_tpu"] is False
