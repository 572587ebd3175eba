"""Compiles the Pallas gated delta rule for a TPU generation on CPU and reports,
per pass (fwd; fwd+bwd: the gradient of sum(out²), a real training step):
memory, each Pallas kernel's static cycle estimate, the XLA glue (summed),
the total, and the total over the roofline floor.

  tokamax-gdn aot --target v6e --model qwen3-next-80b-a3b --seq-len 4096 [--kda] [--json]
  tokamax-gdn aot --target v6e [--specs NAME,...]     # the GDN arg specs tagged 'aot'
  tokamax-gdn aot --op causal_conv1d_gated_delta_rule --target v6e [--implementation xla]
      [--specs NAME,...]    # serving op: cycles, HBM floor, ratio per workload

The shape is the GatedDeltaNet layer's call of the op (`--model` and/or
--hk --hv --k --v), else each GDN arg spec tagged 'aot'. Each pass is compiled
once with the cycle estimate on, at a short length (`--cycle-lengths`, 512),
and its cycles are scaled to --seq-len (two lengths extrapolate along the line
through them, "T2/T1" being the ratio of their totals); memory comes from a
compile at --seq-len (`--scaled-memory` scales it from the short length
instead: faster, but it underestimates, since XLA keeps more in VMEM at short
lengths: 18.5 vs 172 MiB of temporaries for the Qwen3-Next fwd+bwd on v6e).
`--remat-policies recompute,save_gdn,offload_gdn` adds a fwd+bwd pass per
`jax.checkpoint` policy (`ops.gated_delta_rule.remat`), with the bytes it
offloads to host. The roofline floor is max(essential FLOPs / peak FLOP per
cycle, minimal HBM bytes / bytes per cycle), both peaks measured with the
same estimator (`tokamax_gdn.config.TpuGeneration`). `--kda` adds tokamax's
kimi_delta_attention on the same shapes. `--units` adds each Pallas
kernel's VLIW slot use at the first cycle length: its static schedule's
length and the share of each unit's slots (MXU, XLU, VALU, loads, stores,
...) it fills (`aot.bundle_units`; libtpu's LLO text dump: much slower). See
`tokamax_gdn.aot.gated_delta_rule`.

With --op causal_conv1d_gated_delta_rule: per workload (its arg specs tagged
'aot', tokamax's Qwen3.5-397B TP8 set), the static cycles of one call of
--implementation (default: pallas_mosaic_tpu if registered, else xla), the HBM
floor (bytes of pool states read and written + tokens in and out, at the
estimator's HBM rate) and their ratio (`tokamax_gdn.aot.serving`).
"""

import dataclasses
import re
import shlex
import sys

from tokamax_gdn.cli import common

HELP = "compile the Pallas GDN for a TPU generation on CPU: memory, cycles, roofline"
SERVING = "causal_conv1d_gated_delta_rule"


def add_arguments(parser) -> None:
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  parser.add_argument("--target", choices=sorted(config.TPU_GENERATIONS), default="v6e")
  parser.add_argument("--op", choices=("gated_delta_rule", SERVING), default="gated_delta_rule")
  parser.add_argument("--implementation", help=f"{SERVING}: the implementation to compile")
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
  parser.add_argument("--remat-policies", default="",
                      help="comma-separated remat policies (recompute, save_gdn, offload_gdn):"
                      " each adds a fwd+bwd pass under jax.checkpoint with that policy")
  parser.add_argument("--json", action="store_true", help="print the report as JSON")
  parser.add_argument("--record", nargs="?", const="docs/performance.md", default=None,
                      metavar="PATH", help="also write the tables as libtpu static estimates"
                      " into their sections of the performance record (default PATH:"
                      " docs/performance.md; `benchmarks.record`)")
  parser.add_argument("--units", action="store_true",
                      help="each kernel's VLIW slot use (share of each unit's slots its"
                           " schedule fills, at the first cycle length) from libtpu's LLO"
                           " text dump: much slower, gigabytes of temporary files")
  _add_train_step_arguments(parser)


def _add_train_step_arguments(parser) -> None:
  """`tokamax-gdn aot --train-step [--mesh 2x4]` (with the aot command's
  --model, --target, --batch, --seq-len)."""
  parser.add_argument("--train-step", action="store_true",
                      help="compile one whole AdamW training step of --model (a preset with a"
                           " model: section, e.g. qwen3.5-tiny) with the Pallas kernels for a"
                           " data x model mesh of --target; prints memory per device")
  parser.add_argument("--mesh", default="2x4",
                      help="with --train-step: DATAxMODEL devices (a tpu7x 2x2x1 slice has 4"
                      " chips, 8 devices)")


def _run_train_step(args) -> int:
  """Compiles and prints the report (`aot.training`); ValueError for bad arguments."""
  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.models.config import ModelConfig
  from tokamax_gdn.aot import training as train_aot
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
  from tokamax_gdn.benchmarks import workload  # pylint: disable=g-import-not-at-top
  if args.model or any(getattr(args, n) is not None for n in ("hk", "hv", "k", "v")):
    return [common.gdn_shape(args)]
  specs = common.select_specs("gated_delta_rule", args.specs, "aot")
  return [workload.layer_shape(spec.abstract()[0]) for spec in specs]


def _m(x):
  return None if x is None else f"{x / 1e6:.3g}"


def _serving(args) -> int:
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.aot import serving as serving_aot  # pylint: disable=g-import-not-at-top
  impls = registry.implementations(SERVING)
  impl = args.implementation or ("pallas_mosaic_tpu" if "pallas_mosaic_tpu" in impls else "xla")
  registry.get(SERVING, impl)          # a clear error for an unknown name
  specs = common.select_specs(SERVING, args.specs, "aot")
  rows = serving_aot.report(args.target, specs, impl)
  if args.json:
    common.print_json([serving_aot.as_dict(r) for r in rows])
    return 0 if all(r.compiled == "ok" for r in rows) else 1
  steps = lambda d: " ".join(f"{k}={v}" for k, v in d.items()) or None
  table = (
      [dict(spec=r.spec, impl=r.implementation, compiled=r.compiled[:60],
            total=r.total_cycles and f"{r.total_cycles / 1e3:,.1f}",
            hbm=f"{r.hbm_bytes / 2**20:.1f}",
            floor=r.floor_cycles and f"{r.floor_cycles / 1e3:,.1f}",
            ratio=r.total_over_floor and f"{r.total_over_floor:.2f}",
            loops=steps(r.loop_steps)) for r in rows],
      dict(spec="workload", impl="impl", compiled="compiled", total="total kcyc",
           hbm="HBM MiB", floor="HBM floor kcyc", ratio="total/floor", loops="loop steps"),
      f"{SERVING} on {args.target}: static cycles per call vs the HBM floor")
  common.print_table(*table[:2], title=table[2])
  _record(args, f"serving-{impl}-{args.target}", *table)
  if impl == "xla":
    print("xla: the static estimate counts each loop body once; 'loop steps' is how often"
          " each loop runs on the workload, so its total is a lower bound.")
  return 0 if all(r.compiled == "ok" for r in rows) else 1


def run(args) -> int:
  if args.op == SERVING:
    return _serving(args)
  if args.train_step:
    return _run_train_step(args)
  from tokamax_gdn.aot import gated_delta_rule as report_lib  # pylint: disable=g-import-not-at-top
  lengths = [int(t) for t in args.cycle_lengths.split(",") if int(t) > 0]
  from tokamax_gdn.ops.gated_delta_rule import remat  # pylint: disable=g-import-not-at-top
  policies = [p for p in args.remat_policies.split(",") if p]
  for p in policies:
    remat.checkpoint_policy(p)   # a ValueError (exit code 2) for an unknown name
  results = []
  for shape in _shapes(args):
    passes = report_lib.report(args.target, shape, kda=args.kda, cycle_lengths=lengths,
                               full_length_memory=not args.scaled_memory,
                               remat_policies=policies, units=args.units)
    results.append((shape, passes))
  ok = all(p.compiled == "ok" for _, passes in results for p in passes)
  if args.json:
    common.print_json([dict(target=args.target, shape=str(s), cycle_lengths=lengths,
                            passes=[dataclasses.asdict(p) for p in passes])
                       for s, passes in results])
    return 0 if ok else 1
  for shape, passes in results:
    tokens = shape.b * shape.t
    table = (
        [dict(impl=p.impl, pass_=p.pass_, compiled=p.compiled, memory=p.memory_from,
              temp=_mib(p.temp_bytes), host=_mib(p.host_temp_bytes),
              arg=_mib(p.argument_bytes), out=_mib(p.output_bytes), total=_m(p.total_cycles),
              per_token=p.total_cycles and f"{p.total_cycles / tokens:.0f}",
              mxu=_m(p.mxu_cycles), hbm=_m(p.hbm_cycles),
              ratio=p.total_over_floor and f"{p.total_over_floor:.2f}",
              scaling=p.scaling and f"{p.scaling:.2f}", note=p.note[:100]) for p in passes],
        dict(impl="impl", pass_="pass", compiled="compiled", memory="memory", temp="temp MiB",
             host="host MiB",
             arg="arg MiB",
             out="out MiB", total="total Mcyc", per_token="cyc/token", mxu="MXU floor Mcyc",
             hbm="HBM floor Mcyc", ratio="total/floor", scaling="T2/T1", note="note"),
        f"{shape} on {args.target}: cycles scaled from T={lengths}")
    common.print_table(*table[:2], title=table[2])
    _record(args, re.sub(r"[^\w.=-]+", "_", f"gdn-{args.target}-{shape}").strip("_"), *table)
    print()
    common.print_table(
        [dict(impl=p.impl, pass_=p.pass_, kernel=name, cycles=_m(cyc),
              share=f"{100 * cyc / p.total_cycles:.0f}%" if p.total_cycles else None)
         for p in passes for name, cyc in p.kernels.items()],
        dict(impl="impl", pass_="pass", kernel="kernel", cycles="Mcycles", share="share"))
    print()
    if args.units and lengths:
      names = list(dict.fromkeys(n for p in passes for u in p.units.values() for n in u
                                 if n != "bundles"))
      common.print_table(
          [dict(impl=p.impl, pass_=p.pass_, kernel=k, bundles=f"{u['bundles']:.0f}",
                **{n: f"{100 * u.get(n, 0):.0f}%" for n in names})
           for p in passes for k, u in p.units.items()],
          dict(impl="impl", pass_="pass", kernel="kernel", bundles="bundles",
               **{n: n for n in names}),
          title=f"VLIW slot use per kernel at T={lengths[0]} (share of each unit's slots)")
      print()
  return 0 if ok else 1


def _record(args, name: str, rows, columns, title: str) -> None:
  """With --record: the table into its section of the performance record."""
  if not args.record:
    return
  from tokamax_gdn.benchmarks import record  # pylint: disable=g-import-not-at-top
  record.write_section(args.record, name, f"{title} (libtpu static estimates)",
                       "tokamax-gdn " + shlex.join(sys.argv[1:]), rows, columns,
                       device=f"{args.target}, compiled on CPU through libtpu (static estimate)")
  print(f"recorded in {args.record} ({name})")


def _mib(x):
  return None if x is None else f"{x / 2**20:.1f}"
