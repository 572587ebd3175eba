"""Smoke test of `tokamax-gdn bench --op gated_delta_rule` (small shapes)."""

import json

from tokamax_gdn.benchmarks import gated_delta_rule as bench


def test_bench_rows_ratios_and_json(tmp_path, capsys, monkeypatch):
  monkeypatch.setattr(bench, "HK", 1)
  monkeypatch.setattr(bench, "HV", 2)
  monkeypatch.setattr(bench, "DK", 16)
  monkeypatch.setattr(bench, "DV", 16)
  path = tmp_path / "bench.json"
  rc = bench.main(["--seq-lens", "64,256", "--impls", "reference,xla,xla_autodiff",
                   "--reps", "2", "--json", str(path)])
  assert rc == 0
  text = capsys.readouterr().out
  assert "xla: fwd+bwd T=256 / T=64" in text and "(linear: 4.00)" in text
  report = json.loads(path.read_text())
  rows = {(r["impl"], r["t"]): r for r in report["rows"]}
  assert set(rows) == {(i, t) for i in ("reference", "xla", "xla_autodiff") for t in (64, 256)}
  for r in rows.values():
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["residual_bytes"] > 0
  xla = rows[("xla", 256)]
  assert xla["speedup_vs_autodiff"] == rows[("xla_autodiff", 256)]["fwd_bwd_ms"] / xla["fwd_bwd_ms"]
  assert xla["speedup_vs_reference"] == rows[("reference", 256)]["fwd_bwd_ms"] / xla["fwd_bwd_ms"]
  assert report["matmul_flops"] > 0
  assert report["scaling"]["fwd_bwd_ratio"]["xla"] == (
      rows[("xla", 256)]["fwd_bwd_ms"] / rows[("xla", 64)]["fwd_bwd_ms"])
