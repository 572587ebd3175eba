"""`tokamax-gdn train`'s command logic (tokamax_gdn.training.command): the
table and the final line naming the recall accuracy."""

import argparse
import re

from tokamax_gdn.training import command


def _parse(argv):
  p = argparse.ArgumentParser()
  command.add_arguments(p)
  return p.parse_args(argv)


def test_defaults():
  args = _parse([])
  assert args.model == "qwen3.5-micro" and args.impl == "xla" and not args.interpret


def test_short_run_prints_table_and_recall_line(capsys):
  tables = []
  rc = command.run(_parse(["--steps", "3", "--batch", "4", "--seq-len", "8"]), tables.append)
  assert rc == 0
  rows = {r["metric"].strip(): r["value"] for r in tables[0]}
  for key in ("loss at start", "loss at end", "recall accuracy (fresh sequences)",
              "step time (median)", "GDN fwd+bwd (profiled step)", "gmm/tgmm (profiled step)",
              "rest (profiled step)"):
    assert key in rows, rows
  assert rows["steps"] == "3"
  last = capsys.readouterr().out.strip().splitlines()[-1]
  assert re.fullmatch(r"final recall accuracy: \d+\.\d%", last), last
