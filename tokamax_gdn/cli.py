"""`tokamax-gdn`: list | validate | bench | aot | autotune.

`validate` is the main job: every registered implementation of every op runs
on inputs shaped like a model preset's GatedDeltaNet layer (default
`qwen3.5-tiny`) and is compared with `reference`, forward and gradients, then
the whole layer runs through each GDN implementation.
"""

import argparse
import importlib
import json
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

DEFAULT_MODEL = "qwen3.5-tiny"


def print_table(rows: list[dict], file=None) -> None:
  """Plain aligned table from a list of dicts (same keys)."""
  file = file or sys.stdout
  if not rows:
    print("(no rows)", file=file)
    return
  cols = list(rows[0])
  cells = [[str(r.get(c, "")) for c in cols] for r in rows]
  widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
  line = lambda vals: "  ".join(v.ljust(w) for v, w in zip(vals, widths)).rstrip()
  print(line(cols), file=file)
  print(line(["-" * w for w in widths]), file=file)
  for row in cells:
    print(line(row), file=file)


def load_model(spec: str):
  """A preset name (`qwen3.5-tiny`) or a path to a preset .yml."""
  from tokamax_gdn.layers import presets  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig  # pylint: disable=g-import-not-at-top
  if spec.endswith((".yml", ".yaml")) or os.sep in spec:
    return GatedDeltaNetConfig.from_yaml(spec)
  return presets.load_preset(spec)


def _cmd_list(args) -> int:
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  rows = [dict(op=o, implementation=i, op_class=c, config=k) for o, i, c, k in registry.table()]
  if args.json:
    print(json.dumps(rows, indent=1))
  else:
    print_table(rows)
  return 0


def _cmd_validate(args) -> int:
  from tokamax_gdn import validate  # pylint: disable=g-import-not-at-top
  cfg = load_model(args.model)
  rows = validate.run(cfg, seq_len=args.seq_len, batch=args.batch,
                      interpret=args.interpret, progress=not args.json)
  if args.json:
    print(json.dumps(rows, indent=1))
  else:
    print_table(rows)
  failed = [r for r in rows if r["status"].startswith("FAIL")]
  if failed:
    print(f"{len(failed)} check(s) FAILED", file=sys.stderr)
  return 1 if failed else 0


def _delegate(module: str, argv: list[str]) -> int:
  return importlib.import_module(module).main(argv)


_BENCH_MODULES = {
    "gated_delta_rule": "tokamax_gdn.benchmarks.gated_delta_rule",
    "gmm": "tokamax_gdn.benchmarks.gmm",
}


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  parser = argparse.ArgumentParser(prog="tokamax-gdn", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  p = sub.add_parser("list", help="print the registry: ops x implementations")
  p.add_argument("--json", action="store_true")
  p = sub.add_parser("validate", help="every implementation vs reference on a model preset")
  p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or .yml path")
  p.add_argument("--seq-len", type=int, default=64)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--interpret", action="store_true",
                 help="off TPU, also run pallas_mosaic_tpu in Pallas interpret mode (slow)")
  p.add_argument("--json", action="store_true")
  sub.add_parser("bench", help="benchmarks (--op gated_delta_rule|gmm; rest passed on)",
                 add_help=False)
  sub.add_parser("aot", help="compile for a TPU generation on CPU; memory + cycles",
                 add_help=False)
  sub.add_parser("autotune", help="tune configs with tokamax.autotune", add_help=False)

  if argv and argv[0] in ("bench", "aot", "autotune"):
    cmd, rest = argv[0], argv[1:]
    if cmd == "bench":
      op = "gated_delta_rule"
      if "--op" in rest:
        i = rest.index("--op")
        op = rest[i + 1]
        rest = rest[:i] + rest[i + 2:]
      if op not in _BENCH_MODULES:
        parser.error(f"bench --op must be one of {sorted(_BENCH_MODULES)}")
      return _delegate(_BENCH_MODULES[op], rest)
    if cmd == "aot":
      return _delegate("tokamax_gdn.aot", rest)
    return _delegate("tokamax_gdn.tuning", rest)

  args = parser.parse_args(argv)
  start = time.perf_counter()
  rc = {"list": _cmd_list, "validate": _cmd_validate}[args.command](args)
  if args.command != "list" and not getattr(args, "json", False):
    print(f"done in {time.perf_counter() - start:.1f} s")
  return rc


if __name__ == "__main__":
  sys.exit(main())
