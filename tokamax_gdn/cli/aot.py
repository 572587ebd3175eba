"""Compiles the Pallas gated delta rule for a TPU generation on CPU and reports,
per pass (fwd, fwd+bwd): memory, each Pallas kernel's static cycle estimate,
the XLA glue (summed), the total, and the total over the roofline floor.

  tokamax-gdn aot --target v6e --model qwen3-next-80b-a3b --seq-len 4096 [--kda] [--json]
  tokamax-gdn aot --target v6e [--specs NAME,...]     # the GDN arg specs tagged 'aot'

The shape is the GatedDeltaNet layer's call of the op (`--model` and/or
--hk --hv --k --v), else each GDN arg spec tagged 'aot'. Each pass is compiled
once with the cycle estimate on, at a short length (`--cycle-lengths`, 512),
and its cycles are scaled to --seq-len (two lengths extrapolate along the line
through them, "T2/T1" being the ratio of their totals); memory comes from a
compile at --seq-len (`--scaled-memory` scales it from the short length
instead: faster, but it underestimates, since XLA keeps more in VMEM at short
lengths: 18 vs 139 MiB of temporaries for the Qwen3-Next fwd+bwd on v6e). The roofline floor is max(essential FLOPs / peak FLOP per cycle, minimal HBM bytes
/ bytes per cycle), both peaks measured with the same estimator
(`tokamax_gdn.config.TpuGeneration`). `--kda` adds tokamax's
kimi_delta_attention on the same shapes. See `tokamax_gdn.benchmarks.gated_delta_rule_aot`.
"""

import dataclasses

from tokamax_gdn.cli import common

HELP = "compile the Pallas GDN for a TPU generation on CPU: memory, cycles, roofline"


def add_arguments(parser) -> None:
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  parser.add_argument("--target", choices=sorted(config.TPU_GENERATIONS), default="v6e")
  common.add_gdn_shape_args(parser, model_default=None, seq_len_default=4096)
  parser.add_argument("--specs", help="without --model/--hk..: comma-separated GDN arg-spec"
                      " names (default: those tagged 'aot')")
  parser.add_argument("--kda", action="store_true",
                      help="also compile tokamax's kimi_delta_attention on the same shapes")
  parser.add_argument("--cycle-lengths", default="512",
                      help="short length(s) of the cycle-estimate compiles, comma-separated"
                      " (0: none; memory at --seq-len only)")
  parser.add_argument("--scaled-memory", action="store_true",
                      help="scale memory from the short compiles instead of compiling at"
                      " --seq-len (faster; underestimates temporaries)")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  _add_train_step_arguments(parser)


def _add_train_step_arguments(parser) -> None:
  """`tokamax-gdn aot --train-step [--mesh 2x4]` (with the aot command's
  --model, --target, --batch, --seq-len)."""
  parser.add_argument("--train-step", action="store_true",
                      help="compile one whole AdamW training step of --model (a preset with a"
                           " model: section, e.g. qwen3.5-tiny) with the Pallas kernels for a"
                           " data x model mesh of --target; prints memory per device")
  parser.add_argument("--mesh", default="2x4",
                      help="with --train-step: DATAxMODEL chips (tpu7x 2x2x1 has 8)")


def _run_train_step(args) -> int:
  """Compiles and prints the report (`training.aot`); ValueError for bad arguments."""
  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.models.config import ModelConfig
  from tokamax_gdn.training import aot as train_aot
  # pylint: enable=g-import-not-at-top
  if not getattr(args, "model", None):
    raise ValueError("--train-step needs --model (a preset with a model: section, e.g."
                     " qwen3.5-tiny).")
  try:
    n_data, n_model = (int(x) for x in args.mesh.lower().split("x"))
  except ValueError as e:
    raise ValueError(f"--mesh {args.mesh!r}: expected DATAxMODEL, e.g. 2x4.") from e
  batch = max(args.batch or 0, n_data)
  report = train_aot.compile_train_step(
      ModelConfig.load(args.model), target=args.target, batch=batch, seq_len=args.seq_len,
      mesh_shape=(n_data, n_model))
  print(f"{args.model}: one training step ({report.param_count / 1e6:.1f} M params, batch"
        f" {report.batch}, T {report.seq_len}) compiled for {report.target} as a"
        f" {n_data} (data) x {n_model} (model) mesh, {report.mosaic_kernels} Mosaic kernel"
        " calls; memory per device:")
  common.print_table(report.rows())
  return 0


def _shapes(args) -> list:
  from tokamax_gdn.ops.gated_delta_rule import workload  # pylint: disable=g-import-not-at-top
  if args.model or any(getattr(args, n) is not None for n in ("hk", "hv", "k", "v")):
    return [common.gdn_shape(args)]
  specs = common.select_specs("gated_delta_rule", args.specs, "aot")
  return [workload.layer_shape(spec.abstract()[0]) for spec in specs]


def _m(x):
  return None if x is None else f"{x / 1e6:.3g}"


def run(args) -> int:
  if args.train_step:
    return _run_train_step(args)
  from tokamax_gdn.benchmarks import gated_delta_rule_aot as report_lib  # pylint: disable=g-import-not-at-top
  lengths = [int(t) for t in args.cycle_lengths.split(",") if int(t) > 0]
  results = []
  for shape in _shapes(args):
    passes = report_lib.report(args.target, shape, kda=args.kda, cycle_lengths=lengths,
                               full_length_memory=not args.scaled_memory)
    results.append((shape, passes))
  ok = all(p.compiled == "ok" for _, passes in results for p in passes)
  if args.json:
    common.print_json([dict(target=args.target, shape=str(s), cycle_lengths=lengths,
                            passes=[dataclasses.asdict(p) for p in passes])
                       for s, passes in results])
    return 0 if ok else 1
  for shape, passes in results:
    tokens = shape.b * shape.t
    common.print_table(
        [dict(impl=p.impl, pass_=p.pass_, compiled=p.compiled, memory=p.memory_from,
              temp=_mib(p.temp_bytes),
              arg=_mib(p.argument_bytes), out=_mib(p.output_bytes), total=_m(p.total_cycles),
              per_token=p.total_cycles and f"{p.total_cycles / tokens:.0f}",
              mxu=_m(p.mxu_cycles), hbm=_m(p.hbm_cycles),
              ratio=p.total_over_floor and f"{p.total_over_floor:.2f}",
              scaling=p.scaling and f"{p.scaling:.2f}", note=p.note[:100]) for p in passes],
        dict(impl="impl", pass_="pass", compiled="compiled", memory="memory", temp="temp MiB",
             arg="arg MiB",
             out="out MiB", total="total Mcyc", per_token="cyc/token", mxu="MXU floor Mcyc",
             hbm="HBM floor Mcyc", ratio="total/floor", scaling="T2/T1", note="note"),
        title=f"{shape} on {args.target}: cycles scaled from T={lengths}")
    print()
    common.print_table(
        [dict(impl=p.impl, pass_=p.pass_, kernel=name, cycles=_m(cyc),
              share=f"{100 * cyc / p.total_cycles:.0f}%" if p.total_cycles else None)
         for p in passes for name, cyc in p.kernels.items()],
        dict(impl="impl", pass_="pass", kernel="kernel", cycles="Mcycles", share="share"))
    print()
  return 0 if ok else 1


def _mib(x):
  return None if x is None else f"{x / 2**20:.1f}"
