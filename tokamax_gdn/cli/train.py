"""Trains a small Qwen3.5-style decoder (GatedDeltaNet and softmax-attention
blocks, routed MoE MLPs on gmm) from scratch on multi-query associative
recall (`training.data`), and prints a table: loss at start and end, recall
accuracy on fresh sequences (teacher-forced, then with the answers generated
token by token through `models.generate`: `training.recall`), the step time
split into GDN fwd+bwd, gmm/tgmm and the rest (from one profiled step), and
a last line with the (teacher-forced) recall accuracy.

  tokamax-gdn train [--model qwen3.5-micro] [--steps N] [--impl xla|pallas_mosaic_tpu]
                    [--batch B --seq-len T] [--interpret] [--lr LR] [--seed S] [--json]

With `--interpret` (Pallas TPU kernels in interpret mode on CPU) it runs
`INTERPRET_STEPS` steps at a toy shape, then the same steps with `xla`, and
checks that the losses agree within the bf16 tolerance (exit code 1 if not).
The library it drives is `tokamax_gdn.training`.
"""

import argparse
import dataclasses
import json
import logging
import math
import sys

from tokamax_gdn.cli import common

HELP = "train a small Qwen3.5-style model on associative recall (CPU is enough)"

DEFAULT_MODEL = "qwen3.5-micro"
# Defaults measured to reach > 90 % recall within 5 minutes on a loaded
# 2-core CPU (README: "Training").
DEFAULT_STEPS = 300
DEFAULT_BATCH = 128
DEFAULT_SEQ_LEN = 16
DEFAULT_LR = 3e-3
STOP_AT_ACCURACY = 0.96
INTERPRET_STEPS = 3
INTERPRET_BATCH = 2
INTERPRET_SEQ_LEN = 16
BF16_RTOL = 2e-2


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or .yml path")
  p.add_argument("--steps", type=int, help=f"default {DEFAULT_STEPS} ({INTERPRET_STEPS} with"
                 " --interpret); stops early once the recall accuracy of the last 10 steps"
                 f" reaches {STOP_AT_ACCURACY * 100:.0f}%% unless --steps is given")  # %%: argparse formats help
  p.add_argument("--impl", default="xla", help="implementation of every op (xla,"
                 " pallas_mosaic_tpu, reference)")
  p.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULT_BATCH})")
  p.add_argument("--seq-len", type=int, help="tokens per sequence, a multiple of 4: seq-len/4"
                 f" key-value pairs and as many queries (default {DEFAULT_SEQ_LEN})")
  p.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak AdamW learning rate")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--interpret", action="store_true",
                 help="run pallas_mosaic_tpu in Pallas interpret mode on CPU: a few steps at a"
                      " toy shape, compared with xla")
  p.add_argument("--json", action="store_true", help="print the result as JSON")


def _pct(x: float | None) -> str:
  return "-" if x is None else f"{x:.1%}"


def _fmt_s(seconds: float) -> str:
  return f"{seconds * 1e3:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def result_rows(result, task) -> list[dict[str, str]]:
  """The final table: one (metric, value) row each."""
  rows = [dict(metric="loss at start", value=f"{result.start_loss:.4f}"),
          dict(metric="loss at end", value=f"{result.end_loss:.4f}"),
          dict(metric="recall accuracy (fresh sequences)", value=f"{result.recall_accuracy:.1%}"),
          dict(metric="recall accuracy, answers generated", value=_pct(result.generated_recall)),
          dict(metric="steps", value=str(len(result.history))),
          dict(metric="step time (median)", value=_fmt_s(result.step_seconds))]
  if result.split:
    step = result.split["step"]
    for name, label in (("gdn", "GDN fwd+bwd"), ("gmm/tgmm", "gmm/tgmm"), ("rest", "rest")):
      rows.append(dict(metric=f"  {label} (profiled step)",
                       value=f"{_fmt_s(result.split[name])} ({result.split[name] / step:.0%})"))
  rows += [dict(metric="tokens/s", value=f"{result.tokens_per_second:,.0f}"),
           dict(metric="compile time", value=_fmt_s(result.compile_seconds)),
           dict(metric="total time", value=_fmt_s(result.total_seconds)),
           dict(metric="task", value=f"{task.num_pairs} pairs, {task.num_queries} queries,"
                                     f" {task.num_keys} keys, {task.num_values} values")]
  return rows


def run(args: argparse.Namespace, print_table=common.print_table) -> int:
  """Runs the command; returns the exit code. `print_table(rows)` prints rows."""
  # pylint: disable=g-import-not-at-top
  from absl import logging as absl_logging
  from tokamax_gdn import config
  from tokamax_gdn.models.config import ModelConfig
  from tokamax_gdn.training import loop
  from tokamax_gdn.training.data import RecallTask
  from tokamax_gdn.training.step import StepConfig
  # pylint: enable=g-import-not-at-top
  common.require_positive(args, "batch", "steps", "seq_len")
  # Autotuning-cache misses (expected at these shapes: the heuristics apply)
  # are logged as warnings on every trace.
  absl_logging.set_verbosity(absl_logging.ERROR)
  logging.getLogger("jax").setLevel(logging.ERROR)

  interpret = args.interpret
  # None is "not given"; 0 is refused above, never a default.
  pick = lambda given, when_interpret, default: (
      given if given is not None else when_interpret if interpret else default)
  steps = pick(args.steps, INTERPRET_STEPS, DEFAULT_STEPS)
  batch = pick(args.batch, INTERPRET_BATCH, DEFAULT_BATCH)
  task = RecallTask.for_seq_len(pick(args.seq_len, INTERPRET_SEQ_LEN, DEFAULT_SEQ_LEN))
  cfg = ModelConfig.load(args.model, vocab_size=task.vocab_size)
  stop = None if (args.steps is not None or interpret) else STOP_AT_ACCURACY
  impl = "pallas_mosaic_tpu" if interpret and args.impl == "xla" else args.impl

  def run_with(implementation, progress):
    tcfg = loop.TrainConfig(
        steps=steps, batch_size=batch, learning_rate=args.lr, seed=args.seed,
        warmup_steps=min(10, steps // 10), stop_at_accuracy=stop,
        generated_recall=not interpret,     # the interpret run compares losses only
        step=StepConfig(implementation=implementation),
        profile_step=1 if steps > 2 else None)
    return loop.train(cfg, task, tcfg, progress=progress)

  if interpret:
    with config.interpret_mode(True):
      result = run_with(impl, progress=not args.json)
  else:
    result = run_with(impl, progress=not args.json)
  rows = result_rows(result, task)
  rc = 0
  if interpret:
    ref = run_with("xla", progress=False)
    got = [h["loss"] for h in result.history]
    want = [h["loss"] for h in ref.history]
    ok = all(math.isclose(a, b, rel_tol=BF16_RTOL) for a, b in zip(got, want))
    rows.append(dict(metric=f"losses {impl} (interpret)", value=" ".join(f"{x:.4f}" for x in got)))
    rows.append(dict(metric="losses xla", value=" ".join(f"{x:.4f}" for x in want)))
    rows.append(dict(metric=f"equal within bf16 tolerance ({BF16_RTOL})", value=str(ok)))
    rc = 0 if ok else 1
  if args.json:     # stdout holds the JSON only (the accuracy is in its rows)
    print(json.dumps(dict(rows={r["metric"].strip(): r["value"] for r in rows},
                          recall_accuracy=result.recall_accuracy,
                          generated_recall=result.generated_recall,
                          history=result.history, model=dataclasses.asdict(cfg)), indent=1,
                     default=str))
  else:
    print_table(rows)
    print(f"final recall accuracy: {result.recall_accuracy:.1%}", file=sys.stdout)
  return rc
