"""Every implementation of every op against `reference` at a model preset's shapes.

Inputs are fresh random arrays shaped like one GatedDeltaNet layer of the
preset; each row gives the forward and gradient rel-RMS errors against
`reference` and PASS/FAIL against the numerical contract; then the whole
layer runs through each GDN implementation. Off TPU the Pallas kernels are
skipped unless `--interpret` runs them in Pallas interpret mode (slow).
Nearly all of the time is compiling: every program is compiled first, in
parallel (`--workers`), then each runs. Exit code 1 if any check fails.
"""

import sys
import time

from tokamax_gdn.cli import common

HELP = "every implementation vs reference on a model preset"


def add_arguments(parser) -> None:
  parser.add_argument("--model", default=common.DEFAULT_MODEL, help="preset name or .yml path")
  parser.add_argument("--seq-len", type=int, default=64)
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--interpret", action="store_true",
                      help="off TPU, also run pallas_mosaic_tpu in Pallas interpret mode (slow)")
  parser.add_argument("--workers", type=int, default=None,
                      help="compiles at once (default: one per CPU; 1: one after another)")
  parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args) -> int:
  from tokamax_gdn import validate  # pylint: disable=g-import-not-at-top
  common.require_positive(args, "seq_len", "batch", "workers")
  cfg = common.load_model(args.model)
  start = time.perf_counter()
  rows = validate.run(cfg, seq_len=args.seq_len, batch=args.batch,
                      interpret=args.interpret, progress=not args.json,
                      workers=args.workers)
  if args.json:
    common.print_json(rows)
  else:
    common.print_table(rows)
    print(f"done in {time.perf_counter() - start:.1f} s")
  failed = [r for r in rows if r["status"].startswith("FAIL")]
  if failed:
    print(f"{len(failed)} check(s) FAILED", file=sys.stderr)
  return 1 if failed else 0
