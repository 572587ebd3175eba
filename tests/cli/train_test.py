"""`tokamax-gdn train` (tokamax_gdn.cli.train): the table and the final
line naming the recall accuracy."""

import argparse
import contextlib
import io
import json
import re

import pytest

from tokamax_gdn.cli import train
from tokamax_gdn.training import loop

# qwen3.5-micro's structure (GDN and attention blocks, routed MoE) at the
# smallest width: the command's logic, not the model, is under test here.
_TOY = """\
name: toy
variant: qwen3_5
hidden_size: 32
num_k_heads: 1
num_v_heads: 2
head_k_dim: 16
head_v_dim: 16
conv_kernel_size: 4
model:
  num_layers: 2
  full_attention_interval: 2
  num_attention_heads: 2
  num_key_value_heads: 1
  head_dim: 16
  num_experts: 2
  num_experts_per_tok: 1
  moe_intermediate_size: 16
  vocab_size: 8
"""


def _parse(argv):
  p = argparse.ArgumentParser()
  train.add_arguments(p)
  return p.parse_args(argv)


def test_defaults(monkeypatch):
  args = _parse([])
  assert args.model == "qwen3.5-micro" and args.impl is None and not args.interpret
  # --impl's default: the Pallas kernels where they run, else xla.
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  assert train.default_impl(interpret=False) == "xla"     # this CPU
  assert train.default_impl(interpret=True) == "pallas_mosaic_tpu"
  monkeypatch.setattr(config, "on_tpu", lambda: True)
  assert train.default_impl(interpret=False) == "pallas_mosaic_tpu"


@pytest.fixture(scope="module")
def toy_run(tmp_path_factory):
  """One short real run (table output): (tables, stdout, the TrainResult)."""
  model = tmp_path_factory.mktemp("toy") / "toy.yml"
  model.write_text(_TOY)
  tables, results, out = [], [], io.StringIO()
  real_train = loop.train

  def run_and_keep(*a, **kw):
    results.append(real_train(*a, **kw))
    return results[-1]

  loop.train = run_and_keep
  try:
    with contextlib.redirect_stdout(out):
      rc = train.run(_parse(["--model", str(model), "--steps", "3", "--batch", "32",
                             "--seq-len", "8"]), tables.append)
  finally:
    loop.train = real_train
  assert rc == 0
  return tables, out.getvalue(), results[0], str(model)


def test_short_run_prints_table_and_recall_line(toy_run):
  tables, stdout, _, _ = toy_run
  rows = {r["metric"].strip(): r["value"] for r in tables[0]}
  for key in ("loss at start", "loss at end", "recall accuracy (fresh sequences)",
              "recall accuracy, answers generated",
              "step time (median)", "GDN fwd+bwd (profiled step)", "gmm/tgmm (profiled step)",
              "rest (profiled step)"):
    assert key in rows, rows
  assert rows["steps"] == "3"
  last = stdout.strip().splitlines()[-1]
  assert re.fullmatch(r"final recall accuracy: \d+\.\d%", last), last


def test_json_stdout_is_json_only(toy_run, monkeypatch, capsys):
  """With --json, stdout parses as one JSON document (the recall accuracy is
  one of its rows). The training itself is the fixture's."""
  _, _, result, model = toy_run
  monkeypatch.setattr(loop, "train", lambda *a, **kw: result)
  assert train.run(_parse(["--model", model, "--steps", "3", "--batch", "32", "--seq-len", "8",
                           "--json"]), None) == 0
  doc = json.loads(capsys.readouterr().out)
  assert doc["rows"]["recall accuracy (fresh sequences)"] == f"{result.recall_accuracy:.1%}"
