"""Tunes an op's configs for a model's shapes with tokamax's autotuner.

  tokamax-gdn autotune --model qwen3.5-tiny --seq-len 8192 [--op gated_delta_rule]
      [--impl xla] [--batch 1] [--dtype bfloat16] [--hk 2 --hv 4 --k 128 --v 128]
      [--only chunk_size=64,128 --only save_states=False]
      [--out result.json] [--install] [--json]

The inputs are those `GatedDeltaNet` passes the op (q, k, v, raw gate, beta in
the activation dtype; float32 `a_log`/`dt_bias`; `use_qk_l2norm=True`), so the
tuned entries are the ones the layer looks up. Both the forward Op (called
alone, and inside `jax.grad`, whose cache keys differ by `return_residuals`)
and its VJP Op are tuned. `--out` writes the `tokamax.AutotuningResult` JSON
(`AutotuningResult.loads` reads it back; usable as a context manager);
`--install` merges it into `tokamax_gdn/data/autotuning/<device>/<op>.json`,
which the ops read as their shipped autotuning cache.
"""

import pathlib
import sys
import time

from tokamax_gdn.cli import common

HELP = "tune configs with tokamax.autotune"

_COLUMNS = dict(op="op", implementation="impl", pass_="pass", shape="shape",
                best_config="best config", median_ms="median ms",
                heuristics_config="heuristics", heuristics_ms="heur. ms", speedup="speedup")


def add_arguments(parser) -> None:
  common.add_gdn_shape_args(parser, model_default=None, seq_len_default=None)
  parser.add_argument("--op", action="append", help="op to tune (repeatable;"
                      " default gated_delta_rule, the only one with tunable configs)")
  parser.add_argument("--impl", action="append",
                      help="implementation (repeatable; default: the backend's tunable ones)")
  parser.add_argument("--forward-only", action="store_true", help="skip the VJP ops")
  parser.add_argument("--only", action="append", metavar="FIELD=V1,V2",
                      help="explore only configs whose FIELD is one of the values (repeatable;"
                      " the heuristics' config is always timed, for the speedup)")
  parser.add_argument("--timeout", type=float, default=600.0,
                      help="compile timeout per config (s)")
  parser.add_argument("--out", help="write the AutotuningResult JSON here")
  parser.add_argument("--install", action="store_true",
                      help="merge the result into tokamax_gdn/data/autotuning (shipped cache)")
  parser.add_argument("--install-dir", help="with --install: another root instead of the package's")
  parser.add_argument("--json", action="store_true", help="print the table as JSON")
  parser.add_argument("--no-progress", action="store_true")


def run(args) -> int:
  from tokamax_gdn import autotuning  # pylint: disable=g-import-not-at-top
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import autotune as tune  # pylint: disable=g-import-not-at-top
  shape = common.gdn_shape(args)
  results, rows = [], []
  start = time.perf_counter()
  for op_name in args.op or ["gated_delta_rule"]:
    impls = args.impl or tune.tunable_implementations(op_name)
    for impl in impls:
      registry.get(op_name, impl)  # an unknown name is a ValueError listing the valid ones
      items = tune.bound_args(op_name, impl, shape, backward=not args.forward_only)
      if not items:
        print(f"{op_name}/{impl}: nothing tunable (no Config)", file=sys.stderr)
        continue
      result = tune.tune(items, timeout=args.timeout, progress=not args.no_progress,
                         keep=tune.config_filter(args.only or ()))
      results.append(result)
      rows += tune.table_rows(items, result, op_name, impl, shape)
  if not results:
    return 1
  merged = results[0]
  for r in results[1:]:
    merged = merged | r
  elapsed = time.perf_counter() - start
  written = []
  if args.out:
    pathlib.Path(args.out).write_text(merged.dumps(prune_errors=True))
    written.append(args.out)
  if args.install:
    written += [str(p) for p in autotuning.install(merged, args.install_dir)]
  if args.json:
    common.print_json(dict(device_kind=merged.device_kind, seconds=round(elapsed, 1),
                           rows=rows, written=written))
  else:
    print(f"device: {merged.device_kind}   ({elapsed:.0f} s)")
    common.print_table([dict(r, speedup=r["speedup"] and f"{r['speedup']:.2f}x") for r in rows],
                       _COLUMNS)
    for w in written:
      print(f"wrote {w}")
  return 0 if all(r["best_config"] is not None for r in rows) else 1
