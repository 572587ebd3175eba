"""Trains a small Qwen3.5-style decoder (GatedDeltaNet and softmax-attention
blocks, routed MoE MLPs on gmm) from scratch on multi-query associative
recall (`training.data`), and prints a table: loss at start and end, recall
accuracy on fresh sequences (teacher-forced, then with the answers generated
token by token through `models.generate`: `training.recall`), the step time
split into GDN fwd+bwd, gmm/tgmm and the rest (from one profiled step), and
a last line with the (teacher-forced) recall accuracy.

  tokamax-gdn train [--model qwen3.5-micro] [--steps N] [--impl xla|pallas_mosaic_tpu]
                    [--batch B --seq-len T] [--dtype bfloat16] [--interpret] [--lr LR]
                    [--seed S] [--json] [--profile-step] [--compare-impls IMPL,IMPL]
                    [--top-ops N]

With `--interpret` (Pallas TPU kernels in interpret mode on CPU) it runs a
few steps (`--steps`, default below) at a toy shape, then the same steps
with `xla`, and checks that the losses agree within the bf16 tolerance (exit
code 1 if not).

How fast the step runs on a chip: `--profile-step` adds to the
table the model FLOPs per step and the MFU (`training.flops`: against the
chip's published bf16 peak and a bf16 matmul's rate measured in the same
run), and prints the profiled step's device time split into GDN, gmm/tgmm,
attention and the rest (`training.step_split`; on CPU there is no device
track: it says the split needs a TPU). `--compare-impls pallas_mosaic_tpu,xla`
trains nothing: it measures `--steps` steps (default below) of each
implementation in one process (`training.measure`) and prints one row per
implementation: step time, tokens/s, MFU and the split (exit code 1 if one
failed; its row says why). `--top-ops N` adds, per implementation, the N
instructions with the most device time in its profiled step, with their
bucket, pass (forward or backward), jnp operation and source line
(`training.step_split.top_instructions`): where the split's "rest" goes.
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
# 2-core CPU (docs/models.md, "Training").
DEFAULT_STEPS = 300
DEFAULT_BATCH = 128
DEFAULT_SEQ_LEN = 16
DEFAULT_LR = 3e-3
STOP_AT_ACCURACY = 0.96
INTERPRET_STEPS = 3
COMPARE_STEPS = 10
DTYPES = ("float32", "bfloat16")
INTERPRET_BATCH = 2
INTERPRET_SEQ_LEN = 16
BF16_RTOL = 2e-2


def add_arguments(p: argparse.ArgumentParser) -> None:
  p.add_argument("--model", default=DEFAULT_MODEL, help="preset name or .yml path")
  p.add_argument("--steps", type=int, help=f"default {DEFAULT_STEPS} ({INTERPRET_STEPS} with"
                 " --interpret); stops early once the recall accuracy of the last 10 steps"
                 f" reaches {STOP_AT_ACCURACY * 100:.0f}%% unless --steps is given")  # %%: argparse formats help
  p.add_argument("--impl", default=None, help="implementation of every op (xla,"
                 " pallas_mosaic_tpu, reference); default pallas_mosaic_tpu on a TPU or with"
                 " --interpret, else xla")
  p.add_argument("--batch", type=int, help=f"sequences per step (default {DEFAULT_BATCH})")
  p.add_argument("--seq-len", type=int, help="tokens per sequence, a multiple of 4: seq-len/4"
                 f" key-value pairs and as many queries (default {DEFAULT_SEQ_LEN})")
  p.add_argument("--lr", type=float, default=DEFAULT_LR, help="peak AdamW learning rate")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--interpret", action="store_true",
                 help="run pallas_mosaic_tpu in Pallas interpret mode on CPU: a few steps at a"
                      " toy shape, compared with xla")
  p.add_argument("--json", action="store_true", help="print the result as JSON")
  p.add_argument("--dtype", choices=DTYPES, help="activation dtype (default: the params',"
                 " float32)")
  p.add_argument("--profile-step", action="store_true",
                 help="also report model FLOPs, MFU and the profiled step's device time split"
                      " into GDN, gmm/tgmm, attention and the rest (the split needs a TPU)")
  p.add_argument("--compare-impls", metavar="IMPL,IMPL",
                 help=f"train nothing: time --steps steps (default {COMPARE_STEPS}) of each"
                      " implementation in one process and print one row each: tokens/s, MFU,"
                      " the step's split")
  p.add_argument("--top-ops", type=int, default=0, metavar="N",
                 help="with --compare-impls: also list each implementation's N instructions"
                      " with the most device time in the profiled step, with their split"
                      " bucket, pass and source line (needs a TPU)")


def default_impl(interpret: bool) -> str:
  """`--impl`'s default: the Pallas kernels where they run (a TPU, or Pallas
  interpret mode with --interpret), else xla."""
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  return "pallas_mosaic_tpu" if interpret or config.on_tpu() else "xla"


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


def _ms(seconds: float) -> str:
  return f"{seconds * 1e3:.1f} ms"


def _mfu(x: float | None) -> str:
  return "n/a" if x is None else f"{x:.1%}"


def _flop(x: float) -> str:
  for scale, unit in ((1e12, "TFLOP"), (1e9, "GFLOP"), (1e6, "MFLOP")):
    if x >= scale:
      return f"{x / scale:.3g} {unit}"
  return f"{x:.3g} FLOP"


def flops_line(flops) -> str:
  """The model FLOPs per step and their kinds, one line."""
  return (f"model FLOPs per step: {_flop(flops.total)} (matmuls {_flop(flops.matmul)},"
          f" attention {_flop(flops.attention)}, GDN {_flop(flops.gdn)}; training.flops)")


def rates_line(rates) -> str:
  """What MFU is measured against, one line."""
  if rates.peak_flops is None:
    return f"MFU: n/a on {rates.device_kind} (no TPU peak to compare with)"
  line = f"MFU against {rates.generation}'s bf16 peak {rates.peak_flops / 1e12:.0f} TFLOP/s"
  if rates.matmul_flops:
    line += f" and a bf16 8192³ matmul's {rates.matmul_flops / 1e12:.0f} TFLOP/s in this run"
  return line


def mfu_rows(flops, step_seconds: float, rates) -> list[dict[str, str]]:
  """`--profile-step`'s rows: the MFU of the median step (the FLOPs are
  `flops_line`'s)."""
  from tokamax_gdn.training import flops as flops_lib  # pylint: disable=g-import-not-at-top
  return [dict(metric="MFU (bf16 peak)",
               value=_mfu(flops_lib.mfu(flops.total, step_seconds, rates.peak_flops))),
          dict(metric="MFU (measured bf16 matmul)",
               value=_mfu(flops_lib.mfu(flops.total, step_seconds, rates.matmul_flops)))]


def split_cells(split: dict[str, float] | None) -> dict[str, str]:
  """Bucket -> "ms (% of the step's device time)", or "needs a TPU" for every bucket."""
  from tokamax_gdn.training import step_split  # pylint: disable=g-import-not-at-top
  if split is None:
    return dict.fromkeys(step_split.BUCKETS, "needs a TPU")
  device = split["device"] or 1.0
  return {b: f"{_ms(split[b])} ({split[b] / device:.0%})" for b in step_split.BUCKETS}


NO_SPLIT = ("step split (GDN / gmm/tgmm / attention / rest): needs a TPU; the profile on"
            " {kind} has no device op track")


def split_rows(split: dict[str, float]) -> list[dict[str, str]]:
  """`--profile-step`'s device-time table: one row per bucket, then the total."""
  from tokamax_gdn.training import step_split  # pylint: disable=g-import-not-at-top
  cells = split_cells(split)
  return ([dict(part=step_split.LABELS[b], device_time=cells[b]) for b in step_split.BUCKETS]
          + [dict(part="device total", device_time=_ms(split["device"]))])


def compare_rows(measurements, rates) -> list[dict[str, str]]:
  """`--compare-impls`' table: one row per implementation."""
  rows = []
  for m in measurements:
    if m.error:
      rows.append(dict(impl=m.implementation, step="-", error=m.error))
      continue
    row = dict(impl=m.implementation, step=_ms(m.step_seconds),
               tokens_s=f"{m.tokens_per_second:,.0f}",
               mfu_peak=_mfu(m.mfu(rates.peak_flops)), mfu_matmul=_mfu(m.mfu(rates.matmul_flops)))
    row.update(split_cells(m.split))
    row.update(device=_ms(m.split["device"]) if m.split else "-",
               compile=_fmt_s(m.compile_seconds))
    rows.append(row)
  return rows


COMPARE_COLUMNS = {"impl": "impl", "step": "step", "tokens_s": "tokens/s",
                   "mfu_peak": "MFU (peak)", "mfu_matmul": "MFU (matmul)", "gdn": "GDN",
                   "gmm/tgmm": "gmm/tgmm", "attention": "attention", "rest": "rest",
                   "device": "device total", "compile": "compile", "error": "error"}


def _dtype(args):
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  return None if args.dtype is None else jnp.dtype(args.dtype)


def run_compare(args: argparse.Namespace, print_table=common.print_table) -> int:
  """`--compare-impls`: the same measurement for each implementation (module docstring)."""
  # pylint: disable=g-import-not-at-top
  from tokamax_gdn import registry
  from tokamax_gdn.models.config import ModelConfig
  from tokamax_gdn.training import measure
  from tokamax_gdn.training.data import RecallTask
  # pylint: enable=g-import-not-at-top
  impls = [x.strip() for x in args.compare_impls.split(",") if x.strip()]
  unknown = [x for x in impls if x not in registry.IMPLEMENTATION_NAMES]
  if not impls or unknown:
    raise ValueError(f"--compare-impls {args.compare_impls!r}: give implementations among"
                     f" {', '.join(registry.IMPLEMENTATION_NAMES)}, comma-separated")
  if args.interpret:
    raise ValueError("--compare-impls measures speed; --interpret (CPU emulation) has none")
  steps = args.steps if args.steps is not None else COMPARE_STEPS
  batch = args.batch if args.batch is not None else DEFAULT_BATCH
  task = RecallTask.for_seq_len(args.seq_len if args.seq_len is not None else DEFAULT_SEQ_LEN)
  cfg = ModelConfig.load(args.model, vocab_size=task.vocab_size)
  log = (lambda msg: None) if args.json else (lambda msg: print(msg, file=sys.stderr, flush=True))
  rates = measure.chip_rates(measure=False)
  if rates.generation is not None:
    log("measuring the chip's bf16 matmul rate")
    rates = measure.chip_rates()
  results = []
  for impl in impls:
    log(f"{impl}: compiling and timing {steps} steps (batch {batch}, T = {task.seq_len})")
    results.append(measure.measure_step(cfg, task, impl, batch_size=batch, steps=steps,
                                        dtype=_dtype(args), seed=args.seed,
                                        learning_rate=args.lr, top_ops=args.top_ops))
  rows = compare_rows(results, rates)
  rc = 1 if any(m.error for m in results) else 0
  flops = results[0].flops
  if args.json:
    print(json.dumps(dict(rows=rows, rates=dataclasses.asdict(rates),
                          flops=dict(dataclasses.asdict(flops), total=flops.total),
                          measurements=[dataclasses.asdict(m) for m in results],
                          model=dataclasses.asdict(cfg), batch=batch, seq_len=task.seq_len,
                          dtype=args.dtype or "float32", steps=steps), indent=1, default=str))
    return rc
  columns = {k: v for k, v in COMPARE_COLUMNS.items() if any(k in r for r in rows)}
  print(f"{cfg.name or args.model}: batch {batch}, T = {task.seq_len},"
        f" {args.dtype or 'float32'} activations, {steps} steps timed per implementation")
  print_table(rows, columns)
  print(flops_line(flops))
  print(rates_line(rates))
  if any(m.split is None and not m.error for m in results):
    print(NO_SPLIT.format(kind=rates.device_kind))
  else:
    print("split: device time per step and its share of the device total (training.step_split)")
  for m in results if args.top_ops else ():
    if m.error:
      continue
    if m.top_ops is None:
      print(f"{m.implementation}: --top-ops needs a TPU (no device op track on"
            f" {rates.device_kind})")
      continue
    print(f"{m.implementation}: the {len(m.top_ops)} instructions with the most device time"
          " in the profiled step")
    print_table(top_ops_rows(m.top_ops), TOP_OPS_COLUMNS)
  return rc


TOP_OPS_COLUMNS = {"instruction": "instruction", "ms": "ms", "share": "share",
                   "events": "events", "bucket": "bucket", "pass": "pass", "op": "op",
                   "source": "source"}


def top_ops_rows(top_ops: list[dict]) -> list[dict[str, str]]:
  """`step_split.top_instructions` rows as printed cells."""
  return [dict(r, ms=f"{r['ms']:.3f}", share=f"{r['share']:.1%}", events=f"{r['events']:g}")
          for r in top_ops]


def run(args: argparse.Namespace, print_table=common.print_table) -> int:
  """Runs the command; returns the exit code. `print_table(rows)` prints rows."""
  if getattr(args, "top_ops", 0) < 0:
    raise ValueError(f"--top-ops {args.top_ops}: give a number of instructions >= 1")
  if getattr(args, "top_ops", 0) and not getattr(args, "compare_impls", None):
    raise ValueError("--top-ops lists the profiled step of --compare-impls: add"
                     " --compare-impls IMPL[,IMPL]")
  if getattr(args, "compare_impls", None):
    common.require_positive(args, "batch", "steps", "seq_len")
    return run_compare(args, print_table)
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
  impl = default_impl(interpret) if args.impl is None else args.impl
  profile_step = getattr(args, "profile_step", False)
  # With --profile-step, step 1 (after step 0, the warm-up) even in short runs.
  profiled = (1 if steps > 1 else 0) if profile_step else (1 if steps > 2 else None)
  dtype = _dtype(args) if getattr(args, "dtype", None) else None

  def run_with(implementation, progress):
    tcfg = loop.TrainConfig(
        steps=steps, batch_size=batch, learning_rate=args.lr, seed=args.seed,
        warmup_steps=min(10, steps // 10), stop_at_accuracy=stop,
        generated_recall=not interpret,     # the interpret run compares losses only
        step=StepConfig(implementation=implementation, dtype=dtype),
        profile_step=profiled, device_split=profile_step)
    return loop.train(cfg, task, tcfg, progress=progress)

  if interpret:
    with config.interpret_mode(True):
      result = run_with(impl, progress=not args.json)
  else:
    result = run_with(impl, progress=not args.json)
  rows = result_rows(result, task)
  extra = {}
  if profile_step:
    from tokamax_gdn.training import flops as flops_lib  # pylint: disable=g-import-not-at-top
    from tokamax_gdn.training import measure  # pylint: disable=g-import-not-at-top
    rates = measure.chip_rates()
    flops = flops_lib.step_flops(cfg, batch, task.seq_len)
    rows += mfu_rows(flops, result.step_seconds, rates)
    extra = dict(flops=dict(dataclasses.asdict(flops), total=flops.total),
                 rates=dataclasses.asdict(rates), device_split=result.device_split)
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
                          history=result.history, model=dataclasses.asdict(cfg), **extra),
                     indent=1, default=str))
  else:
    print_table(rows)
    if profile_step:
      print(flops_line(flops))
      print(rates_line(rates))
      if result.device_split is None:
        print(NO_SPLIT.format(kind=rates.device_kind))
      else:
        print_table(split_rows(result.device_split))
    print(f"final recall accuracy: {result.recall_accuracy:.1%}", file=sys.stdout)
  return rc
