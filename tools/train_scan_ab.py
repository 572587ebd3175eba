"""A model's training step with its layers under `lax.scan` against a Python loop.

Usage (on a TPU; the arms alternate in one process, so both see the same chip):
  python tools/train_scan_ab.py [MODEL] [--seq-len 4096] [--impl pallas_mosaic_tpu]
      [--steps 10]

Four arms, `scan`, `unrolled`, `scan again`, `unrolled again`, each
`training.measure.measure_step` at batch 1 with bf16 activations and
`StepConfig(scan=...)` forced, print one JSON line each: step ms, compile
seconds and the device-time split of a profiled step (`training.step_split`).
docs/performance.md, "chip-train-scan", is one run on v5e; it is why
`training.step.UNROLL_MAX_LAYERS` exists.
"""

import argparse
import json
import os
import sys

# Run as a script: the repository root is not on the path.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top,wrong-import-position

from tokamax_gdn.models.config import ModelConfig  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.training import measure  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.training import step as step_lib  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.training.data import RecallTask  # pylint: disable=g-import-not-at-top,wrong-import-position

ARMS = (("scan", True), ("unrolled", False), ("scan again", True), ("unrolled again", False))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("model", nargs="?", default="qwen3.5-tiny", help="preset name or .yml path")
  parser.add_argument("--seq-len", type=int, default=4096)
  parser.add_argument("--impl", default="pallas_mosaic_tpu")
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args(argv)
  task = RecallTask.for_seq_len(args.seq_len)
  cfg = ModelConfig.load(args.model, vocab_size=task.vocab_size)
  for name, scan in ARMS:
    step_cfg = step_lib.StepConfig(implementation=args.impl, dtype=jnp.bfloat16, scan=scan)
    m = measure.measure_step(cfg, task, args.impl, batch_size=1, steps=args.steps,
                             step_cfg=step_cfg)
    split = {k: (v if k == "attributed" else v * 1e3) for k, v in (m.split or {}).items()}
    step_ms = None if m.step_seconds is None else m.step_seconds * 1e3
    print(json.dumps(dict(arm=name, step_ms=step_ms, compile_s=m.compile_seconds, split_ms=split,
                          error=m.error)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
