"""`tokamax-gdn train --profile-step` and `--compare-impls` on CPU: they run,
print the model FLOPs, MFU as n/a and say the split needs a TPU (the chip's
figures come from the same code on a TPU)."""

import argparse
import contextlib
import io
import json
import re

import pytest

from tokamax_gdn.cli import train
from tokamax_gdn.training import recall

from tests.cli.train_test import _TOY


def _parse(argv):
  p = argparse.ArgumentParser()
  train.add_arguments(p)
  return p.parse_args(argv)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp("toy") / "toy.yml"
  path.write_text(_TOY)
  return str(path)


def _run(argv):
  tables, out = [], io.StringIO()
  with contextlib.redirect_stdout(out):
    rc = train.run(_parse(argv), lambda rows, columns=None: tables.append(rows))
  return rc, tables, out.getvalue()


def test_new_flags_default_off():
  args = _parse([])
  assert not args.profile_step and args.compare_impls is None and args.dtype is None


def test_compare_impls_rows_and_a_failing_impl(model):
  """One row per implementation; one that cannot run here (Pallas TPU on
  CPU) gets its error in its row and exit code 1, the other still measures."""
  rc, tables, out = _run(["--model", model, "--compare-impls", "xla,pallas_mosaic_tpu",
                          "--steps", "2", "--batch", "2", "--seq-len", "8"])
  assert rc == 1
  rows = {r["impl"]: r for r in tables[0]}
  assert set(rows) == {"xla", "pallas_mosaic_tpu"}
  xla = rows["xla"]
  assert re.fullmatch(r"[\d.]+ ms", xla["step"]) and float(xla["tokens_s"].replace(",", "")) > 0
  assert xla["mfu_peak"] == "n/a" and xla["gdn"] == "needs a TPU" and "error" not in xla
  assert rows["pallas_mosaic_tpu"]["error"]
  assert "model FLOPs per step:" in out and "MFU: n/a on cpu" in out
  assert "needs a TPU" in out


def test_profile_step_adds_mfu_and_says_the_split_needs_a_tpu(model, monkeypatch):
  # The generated-recall pass (its own compiles) is `train`'s, tested there.
  monkeypatch.setattr(recall, "generated_recall", lambda *a, **kw: 0.5)
  rc, tables, out = _run(["--model", model, "--profile-step", "--steps", "2", "--batch", "4",
                          "--seq-len", "8", "--dtype", "bfloat16"])
  assert rc == 0
  rows = {r["metric"].strip(): r["value"] for r in tables[0]}
  assert rows["MFU (bf16 peak)"] == "n/a" and rows["MFU (measured bf16 matmul)"] == "n/a"
  assert re.search(r"^model FLOPs per step: [\d.]+ [MGT]?FLOP \(matmuls", out, re.M)
  assert "GDN fwd+bwd (profiled step)" in rows      # off TPU: the CPU thunks' split, as before
  assert "step split (GDN / gmm/tgmm / attention / rest): needs a TPU" in out
  assert re.fullmatch(r"final recall accuracy: \d+\.\d%", out.strip().splitlines()[-1])


@pytest.mark.parametrize("argv, message", [
    (["--compare-impls", "xla,cuda"], "give implementations among"),
    (["--compare-impls", "xla", "--interpret"], "--interpret"),
])
def test_compare_impls_refuses(argv, message):
  with pytest.raises(ValueError, match=message):
    train.run(_parse(argv))


def test_compare_impls_json(model, capsys, monkeypatch):
  """--json prints one document: the rows, the rates, the FLOPs and each
  measurement (a canned one here: the measuring is tested above)."""
  from tokamax_gdn.training import measure  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.training import flops  # pylint: disable=g-import-not-at-top
  canned = measure.StepMeasurement("xla", 2, 8, flops.StepFlops(6.0, 1.0, 2.0),
                                   compile_seconds=1.0, step_seconds=0.5)
  monkeypatch.setattr(measure, "measure_step", lambda *a, **kw: canned)
  assert train.run(_parse(["--model", model, "--compare-impls", "xla", "--steps", "1",
                           "--batch", "2", "--seq-len", "8", "--json"])) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["rows"][0]["impl"] == "xla" and doc["rows"][0]["tokens_s"] == "32"
  assert doc["rates"]["peak_flops"] is None and doc["flops"]["total"] == 9.0
  assert doc["measurements"][0]["split"] is None


def test_rows_with_a_tpu_split():
  """The cells a TPU run prints: MFU against both rates, each bucket's ms and
  share of the device total (canned figures)."""
  from tokamax_gdn.training import flops, measure  # pylint: disable=g-import-not-at-top
  split = {"gdn": 0.004, "gmm/tgmm": 0.002, "attention": 0.001, "rest": 0.003, "device": 0.010}
  m = measure.StepMeasurement("pallas_mosaic_tpu", 1, 4096, flops.StepFlops(1e12, 0.0, 0.0),
                              compile_seconds=30.0, step_seconds=0.01, split=split)
  rates = measure.ChipRates("TPU v5 lite", "v5e", peak_flops=200e12, matmul_flops=100e12)
  (row,) = train.compare_rows([m], rates)
  assert row["mfu_peak"] == "50.0%" and row["mfu_matmul"] == "100.0%"
  assert row["gdn"] == "4.0 ms (40%)" and row["rest"] == "3.0 ms (30%)"
  assert row["device"] == "10.0 ms" and row["tokens_s"] == "409,600"
  table = {r["part"]: r["device_time"] for r in train.split_rows(split)}
  assert table["attention core"] == "1.0 ms (10%)" and table["device total"] == "10.0 ms"
  assert "v5e's bf16 peak 200 TFLOP/s" in train.rates_line(rates)


def test_top_ops_table_per_implementation(model, monkeypatch):
  """--top-ops N: measure_step is asked for N rows and each implementation's
  rows are printed as a table; an implementation without them (no device
  track) gets a line saying it needs a TPU."""
  from tokamax_gdn.training import flops, measure  # pylint: disable=g-import-not-at-top
  asked = []
  top = [dict(instruction="fusion.3", bucket="rest", ms=1.5, share=0.25, events=3.0,
              **{"pass": "bwd"}, op="dynamic_update_slice", source="decoder.py:loop")]

  def fake(cfg, task, impl, *, top_ops=0, **kw):
    asked.append(top_ops)
    return measure.StepMeasurement(
        implementation=impl, batch_size=kw["batch_size"], seq_len=task.seq_len,
        flops=flops.StepFlops(1.0, 0.0, 0.0), compile_seconds=1.0, step_seconds=0.01,
        split=None, top_ops=top if impl == "xla" else None)

  monkeypatch.setattr(measure, "measure_step", fake)
  rc, tables, out = _run(["--model", model, "--compare-impls", "xla,reference", "--steps", "2",
                          "--batch", "2", "--seq-len", "8", "--top-ops", "5"])
  assert rc == 0 and asked == [5, 5]
  assert tables[1] == [dict(top[0], ms="1.500", share="25.0%", events="3")]
  assert "xla: the 1 instructions with the most device time" in out
  assert "reference: --top-ops needs a TPU" in out


@pytest.mark.parametrize("argv, message", [
    (["--top-ops", "3"], "add --compare-impls"),
    (["--compare-impls", "xla", "--top-ops", "-1"], ">= 1"),
])
def test_top_ops_refuses(argv, message):
  with pytest.raises(ValueError, match=message):
    train.run(_parse(argv))
