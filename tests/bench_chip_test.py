"""The on-chip bench's tables (`benchmarks/on_chip.py`, `cli/bench_chip.py`),
run on CPU at tiny shapes with given floors: rows, ratios, failures as rows,
progress lines, and the record section the command writes."""

import json
import time

import jax
import pytest

from tokamax_gdn import cli
from tokamax_gdn.aot import serving as serving_aot
from tokamax_gdn.cli import bench_chip
from tokamax_gdn.benchmarks import on_chip
from tokamax_gdn.benchmarks import serving
from tokamax_gdn.benchmarks import timing
from tokamax_gdn.benchmarks import workload
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

FLOORS = timing.Floors("cpu", "v5e", mxu_flops=1e11, hbm_bytes=1e10, peak_flops=197e12,
                       peak_hbm=819e9)


class _Latent:
  """A result whose wait takes `latency_s`: the latency after a burst's last
  call (a device's pipeline fill and the host's round trip), paid once per wait."""

  def __init__(self, latency_s):
    self.latency_s = latency_s

  def block_until_ready(self):
    time.sleep(self.latency_s)
    return self


def test_wall_ms_steady_state_leaves_out_the_bursts_latency():
  # 10 ms per call plus 200 ms per wait: one burst of 4 calls would read 60 ms
  # a call. (At 2 ms a call a loaded CI machine's sleeps overshot the bound:
  # 4.48 ms; the margins here are wide of what the two readings differ by.)
  def call():
    time.sleep(0.01)
    return _Latent(0.2)

  ms = timing.wall_ms(call, n=4, warm=0)
  assert 9 < ms < 25, ms
  assert timing.timed_calls(4) == 12 and timing.timed_calls(4, sync=True) == 4


def test_wall_ms_steady_state_and_sync():
  f = jax.jit(lambda x: x * 2.0)
  x = jax.numpy.ones((256, 256))
  assert timing.wall_ms(f, x, n=3) > 0 and timing.wall_ms(f, x, n=3, sync=True) > 0
  assert timing.round_trip_ms(n=3) > 0


def test_gdn_rows_floors_and_fixed_cost():
  lines = []
  shape = workload.LayerShape(b=1, t=64, hk=1, hv=2, k=16, v=16)
  rows = on_chip.gdn_rows(FLOORS, shape, (64, 128), ("xla",), policies=(), kda=False, n=2,
                          log=lines.append)
  assert [(r["t"], r["pass_"]) for r in rows] == [(64, "fwd"), (64, "step"), (128, "fwd"),
                                                  (128, "step")]
  for r in rows:
    assert r["ms"] > 0 and r["over_floor"] == pytest.approx(r["ms"] / r["floor_ms"])
    assert r["floor_ms"] == pytest.approx(FLOORS.floor_ms(
        workload.essential_flops(workload.LayerShape(b=1, t=r["t"], hk=1, hv=2, k=16, v=16,
                                                     flat=True), 64,
                                 backward=r["pass_"] == "step"),
        workload.min_hbm_bytes(workload.LayerShape(b=1, t=r["t"], hk=1, hv=2, k=16, v=16,
                                                   flat=True), backward=r["pass_"] == "step")))
  assert len(lines) == 2 * len(rows) and lines[0].endswith("compiling")
  fits = {f["pass_"]: f for f in on_chip.fixed_cost(rows)}
  assert set(fits) == {"fwd", "step"} and fits["fwd"]["lengths"] == [64, 128]


def test_a_peer_that_cannot_run_is_a_row_with_its_reason():
  shape = workload.LayerShape(b=1, t=64, hk=1, hv=2, k=16, v=16)
  rows = on_chip.gdn_rows(FLOORS, shape, (64,), ("pallas_mosaic_tpu",), policies=(), kda=False,
                          n=1)
  assert rows and all(r["ms"] is None and "PallasTpuUnavailableError" in r["error"]
                      and "needs a TPU" in r["error"] for r in rows), rows


def test_command_on_a_tpu_writes_the_record(monkeypatch, tmp_path, capsys):
  """The serving tables: the chained one as markdown, every row, both in the
  record; the report saved as JSON prints and records the same tables again
  (--from-json), with the command and device that measured them."""
  monkeypatch.setattr(timing, "measure_floors", lambda: FLOORS)
  monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
  path, saved = tmp_path / "performance.md", tmp_path / "serving.json"
  code = cli.main(["bench", "--op", "causal_conv1d_gated_delta_rule", "--specs",
                   "tiny_decode_8_ctx", "--impls", "xla", "--reps", "2", "--chain", "2",
                   "--json-out", str(saved), "--record", str(path)])
  assert code == 0
  out = capsys.readouterr()
  assert "tiny_decode_8_ctx" in out.out and "[bench] serving tiny_decode_8_ctx xla" in out.err
  assert "| workload | floor ms | bound | xla | x floor | tokamax_xla |" in out.out
  text = path.read_text()
  assert "<!-- BEGIN chip-serving -->" in text and "| tiny_decode_8_ctx |" in text
  assert "<!-- BEGIN chip-serving-chained -->" in text
  report = json.loads(saved.read_text())
  assert [r["impl"] for r in report["rows"]] == ["xla", "tokamax_xla"]
  assert all(r["chained_ms"] > 0 and r["chain"] == 2 for r in report["rows"])
  again = tmp_path / "again.md"
  assert cli.main(["bench", "--op", "causal_conv1d_gated_delta_rule", "--from-json",
                   str(saved), "--record", str(again)]) == 0
  assert "| workload | floor ms | bound | xla | x floor | tokamax_xla |" in capsys.readouterr().out
  strip = lambda s: [l for l in s.splitlines() if not l[:4].isdigit()]   # (the date line)
  assert strip(again.read_text()) == strip(text)
  assert "device: cpu." in text
  saved.write_text(json.dumps([1]))
  assert cli.main(["bench", "--op", "causal_conv1d_gated_delta_rule", "--from-json",
                   str(saved)]) == 2
  assert "not a report" in capsys.readouterr().err


def test_serving_rows_chained_headline_against_the_floor():
  """Chained ms per call (the headline) beside the call-by-call and device
  times, against the floor at the chip's peaks; nothing hoisted out of the
  chained program's loop."""
  rows = on_chip.serving_rows(FLOORS, ["tiny_mixed_padded_ctx"], ("xla",), tokamax=False, n=2,
                              chain=3)
  [r] = rows
  spec = arg_specs.by_name("tiny_mixed_padded_ctx")
  flops, hbm = serving_aot.essential_flops(spec), serving_aot.hbm_bytes(spec)
  assert (r["flops"], r["hbm_bytes"], r["chain"]) == (flops, hbm, 3)
  assert r["floor_ms"] == pytest.approx(max(flops / 197e12, hbm / 819e9) * 1e3)
  assert r["bound"] == ("MXU" if flops / 197e12 > hbm / 819e9 else "HBM")
  assert r["chained_ms"] > 0 and r["loop_invariant"] == []
  assert r["over_floor"] == pytest.approx(r["chained_ms"] / r["floor_ms"])
  # On CPU the profile has no TPU track: device time 0, but the column is there.
  assert r["ms"] > 0 and r["device_ms"] == 0.0 and r["device_over_floor"] == 0.0
  assert r["pool_layout"] == "auto" and "error" not in r


def test_serving_peers_are_rows():
  """vLLM's kernel is a row with its reason off a TPU (tpu-inference not on
  the path, or its Pallas kernel refusing the CPU); the drop-in runs."""
  rows = on_chip.serving_rows(FLOORS, ["tiny_decode_8_ctx"], (serving.VLLM, serving.VLLM_DROPIN),
                              tokamax=False, n=2, chain=2)
  by_impl = {r["impl"]: r for r in rows}
  assert by_impl["vllm"]["ms"] is None and by_impl["vllm"]["error"]
  assert by_impl["vllm_dropin"]["chained_ms"] > 0


def test_chained_table_one_line_per_workload():
  rows = [dict(spec="a", impl="ours", floor_ms=0.5, bound="HBM", chained_ms=1.0, ms=3.0,
               over_floor=2.0),
          dict(spec="a", impl="peer", floor_ms=0.5, bound="HBM", ms=None, error="no"),
          dict(spec="b", impl="ours", floor_ms=0.1, bound="MXU", ms=0.4, over_floor=4.0)]
  table, columns = on_chip.chained_table(rows)
  assert list(columns.values()) == ["workload", "floor ms", "bound", "ours", "x floor", "peer"]
  assert table == [
      {"spec": "a", "floor_ms": 0.5, "bound": "HBM", "over_floor": 2.0, "ms:ours": 1.0,
       "ms:peer": "failed"},
      # No chained figure: the call-by-call one.
      {"spec": "b", "floor_ms": 0.1, "bound": "MXU", "over_floor": 4.0, "ms:ours": 0.4,
       "ms:peer": None}]


def test_serving_rows_time_either_pool_layout():
  # "auto": the pools placed in the layouts the program picked, fed back call
  # after call; "default": the runtime's. Both run the same calls.
  for layout in ("auto", "default"):
    [r] = on_chip.serving_rows(FLOORS, ["tiny_decode_8_ctx"], ("xla",), tokamax=False, n=2,
                               pool_layout=layout, chain=0)
    assert r["ms"] > 0 and r["pool_layout"] == layout, r
  with pytest.raises(ValueError, match="pool_layout"):
    on_chip.serving_rows(FLOORS, ["tiny_decode_8_ctx"], ("xla",), tokamax=False, n=2,
                         pool_layout="row_major", chain=0)


def test_serving_programs_compile_first_and_a_failure_is_its_row():
  lines = []
  rows = on_chip.serving_rows(FLOORS, ["tiny_decode_8_ctx", "tiny_mixed_padded_ctx"],
                              ("xla", "no_such_impl"), tokamax=False, n=2, log=lines.append,
                              compile_workers=2, chain=0)
  assert [(r["spec"], r["impl"]) for r in rows] == [
      (s, i) for s in ("tiny_decode_8_ctx", "tiny_mixed_padded_ctx")
      for i in ("xla", "no_such_impl")]
  ok = [r for r in rows if r["impl"] == "xla"]
  assert all(r["ms"] > 0 and r["compile_s"] > 0 for r in ok)
  bad = [r for r in rows if r["impl"] == "no_such_impl"]
  assert all(r["ms"] is None and "no_such_impl" in r["error"] for r in bad)
  # Every compile is done (or failed) before the first call is timed.
  first_timed = min(i for i, l in enumerate(lines) if " ms" in l)
  assert sum(("compiled in" in l or "compile failed" in l) for l in lines[:first_timed]) == 4


def test_serving_profile_lists_ops(capsys):
  # `bench --profile`: each serving row keeps its profile's largest ops. On
  # CPU the profile has no TPU track: no ops, but the list is there.
  [r] = on_chip.serving_rows(FLOORS, ["tiny_decode_8_ctx"], ("xla",), tokamax=False, n=2, ops=5,
                             chain=0)
  assert r["ops"] == []
  [r] = on_chip.serving_rows(FLOORS, ["tiny_decode_8_ctx"], ("xla",), tokamax=False, n=2,
                             chain=0)
  assert "ops" not in r
  bench_chip._print_ops([dict(spec="s", impl="i", device_ms=0.05, ops=[  # pylint: disable=protected-access
      dict(name="gdn_serve_decode", thread="XLA Ops", us=37.4, count=1)])])
  assert "gdn_serve_decode" in capsys.readouterr().out


def test_busy_time_counts_nested_events_once():
  # A while loop's op encloses its body's ops on the same track; a second
  # track's events add; tracks the predicate refuses do not.
  events = [("XLA Ops", "while", 0.0, 100.0), ("XLA Ops", "body.1", 10.0, 30.0),
            ("XLA Ops", "body.2", 50.0, 60.0), ("XLA Ops", "after", 120.0, 10.0),
            ("XLA Ops", "overlap", 125.0, 15.0),
            ("Other Ops", "dma", 0.0, 40.0), ("XLA Modules", "jit_step", 0.0, 200.0),
            ("Steps", "1", 0.0, 300.0)]
  ops_only = lambda t: t.endswith("Ops")
  # XLA Ops: [0, 110) ∪ [120, 140) = 130 us; Other Ops: 40 us; per call of 2.
  assert timing.busy_ms(events, 2, ops_only) == pytest.approx((130 + 40) / 2 / 1e3)
  table = timing.op_table(events, 2)
  assert table[0]["name"] == "jit_step" and table[0]["us"] == 100.0
  # The profiler's step markers are not ops.
  assert all(r["thread"] != "Steps" for r in table)


def test_gmm_floor_counts_every_groups_weights():
  m, k, n, g = 64, 32, 16, 8
  rows = on_chip.gmm_rows(FLOORS, shapes=((m, k, n, g),), n=2)
  hbm = 2 * (m * k + g * k * n + m * n)
  for r in rows:
    assert r["hbm_bytes"] == hbm
    assert r["floor_ms"] == pytest.approx(FLOORS.floor_ms(2 * m * k * n, hbm))
  ours = {r["impl"]: r for r in rows if r["op"] == "gmm"}
  assert ours["ours xla"]["ms"] > 0 and ours["ours pallas_mosaic_tpu"]["error"]


def test_mixed_call_against_its_parts(monkeypatch):
  parts = {"mixed": ("a", "b", "b")}
  times = dict(a=1.0, b=0.5)
  asked = []

  def fake_rows(floors, names, impls, tokamax, n, log, pool_layout, chain):
    del floors, tokamax, n, log, pool_layout, chain
    asked.append((list(names), list(impls)))
    return [dict(spec=s, impl=i, ms=times.get(s)) for s in names for i in impls]

  monkeypatch.setattr(on_chip, "serving_rows", fake_rows)
  rows = [dict(spec="mixed", impl="xla", ms=1.8), dict(spec="mixed", impl="ours", ms=2.2),
          dict(spec="other", impl="xla", ms=9.0)]
  out = on_chip.mixed_vs_parts(FLOORS, rows, parts, n=2)
  assert asked == [(["a", "b"], ["xla", "ours"])]      # each part once, every impl of the mixed
  by_impl = {r["impl"]: r for r in out}
  assert by_impl["xla"]["parts_ms"] == pytest.approx(2.0)   # a + b + b
  assert by_impl["xla"]["over_parts"] == pytest.approx(0.9)
  assert by_impl["ours"]["over_parts"] == pytest.approx(1.1)
  assert by_impl["xla"]["parts"] == "a + b + b"
  times["b"] = None                                     # a part that failed: no ratio
  [r, _] = on_chip.mixed_vs_parts(FLOORS, rows, parts, n=2)
  assert r["parts_ms"] is None and r["over_parts"] is None
  assert on_chip.mixed_vs_parts(FLOORS, rows, {}, n=2) == []   # nothing mixed: no rows


def test_every_listed_part_is_a_spec():
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs  # pylint: disable=g-import-not-at-top
  for mixed, parts in arg_specs.PARTS.items():
    whole = arg_specs.layout_of(mixed)
    pieces = [arg_specs.layout_of(p) for p in parts]
    n = lambda lay: int(lay["query_start_loc"][int(lay["distribution"][2])])
    # The parts hold the mixed call's tokens between them.
    assert sum(n(p) for p in pieces) == n(whole), mixed
