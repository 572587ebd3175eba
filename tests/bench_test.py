"""`tokamax-gdn bench --op gated_delta_rule`: the library on tiny specs, and the
command on the op's own small specs."""

import json

from tokamax_gdn import cli
from tokamax_gdn.benchmarks import gated_delta_rule as bench
from tokamax_gdn.ops.gated_delta_rule import arg_specs
from tokamax_gdn.autotuning import ArgSpec


def _spec(t):
  return ArgSpec(name=f"tiny_T{t}", diff_argnames=arg_specs.DIFF, tags=("bench",),
                 make=lambda key: arg_specs.random_inputs(key, b=1, t=t, hk=1, hv=2, dk=16, dv=16))


def test_rows_ratios_and_scaling():
  report = bench.run([_spec(64), _spec(256)], ["reference", "xla", "xla_autodiff"], reps=2)
  rows = {(r["impl"], r["t"]): r for r in report["rows"]}
  assert set(rows) == {(i, t) for i in ("reference", "xla", "xla_autodiff") for t in (64, 256)}
  for r in rows.values():
    assert r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["residual_bytes"] > 0
    assert r["shape"] == f"B1 T{r['t']} Hk1 Hv2 K16 V16 float32"
  xla = rows[("xla", 256)]
  assert xla["speedup_vs_autodiff"] == rows[("xla_autodiff", 256)]["fwd_bwd_ms"] / xla["fwd_bwd_ms"]
  assert xla["speedup_vs_reference"] == rows[("reference", 256)]["fwd_bwd_ms"] / xla["fwd_bwd_ms"]
  assert report["matmul_flops"] > 0
  assert report["scaling"]["xla"] == dict(
      t_lo=64, t_hi=256, fwd_bwd_ratio=xla["fwd_bwd_ms"] / rows[("xla", 64)]["fwd_bwd_ms"])


def test_reference_skipped_past_its_length_limit():
  report = bench.run([_spec(64), _spec(128)], ["reference", "xla"], reps=1, reference_max_t=100)
  assert sorted((r["impl"], r["t"]) for r in report["rows"]) == [
      ("reference", 64), ("xla", 64), ("xla", 128)]


def test_command_reads_the_specs_by_name(capsys):
  rc = cli.main(["bench", "--specs", "mha_T24,gva_1to2_T40_gate", "--impls", "xla",
                 "--reps", "1", "--json"])
  assert rc == 0
  report = json.loads(capsys.readouterr().out)
  assert [(r["spec"], r["impl"]) for r in report["rows"]] == [
      ("mha_T24", "xla"), ("gva_1to2_T40_gate", "xla")]
  assert cli.main(["bench", "--specs", "no_such_spec"]) == 2
  assert "no_such_spec" in capsys.readouterr().err
