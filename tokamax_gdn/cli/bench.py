"""Benchmarks on the op's named workloads (its `arg_specs.py`, tag 'bench' by default).

On a TPU every --op prints wall-clock tables against the chip's floors and
the peers that run there (`tokamax_gdn.cli.bench_chip`):
  tokamax-gdn bench [--op OP] [--lengths 4096,32768] [--profile] [--record [PATH]] [--json]
  tokamax-gdn bench --op causal_conv1d_gated_delta_rule [--specs NAME,...] [--impls ...]
      [--chain 32] [--no-parts] [--json-out PATH] [--record [PATH]]
The serving op's headline there is ms per call with --chain calls chained in
one program (pools carried and donated), beside the call-by-call wall clock
and the device time; its peers are tokamax's `xla` op, vLLM TPU's kernel
(where tpu-inference is on the path) and our vLLM drop-in. Reports saved
with --json-out (several calls' worth) print and record again, anywhere:
  tokamax-gdn bench --op causal_conv1d_gated_delta_rule --from-json A.json,B.json
      [--record [PATH]]
Elsewhere (CPU):

  tokamax-gdn bench [--op gated_delta_rule] [--specs NAME,...] [--tag bench]
      [--impls reference,xla,xla_autodiff] [--reps 7] [--json]
  tokamax-gdn bench --op gmm [--target v6e] [--specs NAME,...] [--tiles tm,tk,tn] [--json]
  tokamax-gdn bench --op causal_conv1d_gated_delta_rule [--specs NAME,...] [--reps 7] [--json]

Generation, on a TPU or (small sizes, `xla`, CPU figures) anywhere:
  tokamax-gdn bench --op generate [--model qwen3.5-tiny] [--batches 1,8,64]
      [--impls pallas_mosaic_tpu,xla] [--prompt-len 128] [--record [PATH]] [--json]

gated_delta_rule (on this machine's default backend): median forward and
forward+backward times, the bytes the VJP keeps for the backward, compiled
fwd+bwd temp bytes and speed ratios against `reference` and against
`xla_autodiff` (xla's forward under JAX autodiff), all timed in interleaved
rounds of the same run; reference runs only for T <= 2048
(`tokamax_gdn.benchmarks.gated_delta_rule`).

gmm (compiled for --target on CPU, no TPU needed): static cycle estimates of
our kernels, tokamax's ragged_dot and a dense matmul of the same size
(`tokamax_gdn.benchmarks.gmm`).

causal_conv1d_gated_delta_rule (on this machine's default backend): median
call times of our serving `xla` (or --impls) and tokamax's `xla` op on the
same inputs, pools donated and fed back, interleaved rounds of one run, and
the ratio tokamax / ours (`tokamax_gdn.benchmarks.serving`).

generate: `models.generate`'s two kinds of step for a model preset at each
batch, prefill (every prompt in one call) and decode (one token per request),
ms and tokens/s, the decode step against its HBM floor (weights, GDN states
and KV cache read once) and, on a TPU, the GDN op's share of the device time
(`tokamax_gdn.benchmarks.generation`).
"""

import sys

from tokamax_gdn.cli import common

HELP = ("benchmarks (--op gated_delta_rule | gmm | causal_conv1d_gated_delta_rule) on the"
        " ops' bench workloads, or --op generate: a model's generation steps")

OPS = ("gated_delta_rule", "gmm", "causal_conv1d_gated_delta_rule", "generate")


def add_arguments(parser) -> None:
  parser.add_argument("--op", choices=OPS, default="gated_delta_rule")
  parser.add_argument("--specs", help="comma-separated arg-spec names of the op"
                      " (default: the specs carrying --tag)")
  parser.add_argument("--tag", default="bench", help="arg-spec tag to run (default bench)")
  parser.add_argument("--impls", help="comma-separated implementations (gated_delta_rule:"
                      " default reference,xla,xla_autodiff, 'xla_autodiff' being xla's forward"
                      " under JAX autodiff; causal_conv1d_gated_delta_rule: default xla, with"
                      " tokamax's xla always added)")
  parser.add_argument("--reps", type=int, default=None,
                      help="timed rounds (CPU benches); on a TPU, timed calls (default 20)")
  parser.add_argument("--target", default="v6e", help="gmm: TPU generation to compile for")
  parser.add_argument("--tiles", help="gmm: also compile ours with tm,tk,tn")
  parser.add_argument("--json", action="store_true", help="print the results as JSON")
  parser.add_argument("--lengths", default="4096,32768",
                      help="TPU, gated_delta_rule: sequence lengths of the layer shape")
  parser.add_argument("--profile", action="store_true",
                      help="TPU, gated_delta_rule and causal_conv1d_gated_delta_rule: device"
                      " time per kernel and XLA op")
  parser.add_argument("--pool-layout", choices=("auto", "default"), default="auto",
                      help="TPU, causal_conv1d_gated_delta_rule: the pools' layout, XLA's choice"
                      " for each program (auto: the pools placed in it once, as an engine"
                      " allocates them) or the runtime's default at the jit boundary")
  parser.add_argument("--model", help="generate: model preset name or .yml path (default"
                      f" {common.DEFAULT_MODEL})")
  parser.add_argument("--batches", help="generate: comma-separated request counts (default"
                      " 1,8,64 on a TPU, 1,8 elsewhere)")
  parser.add_argument("--prompt-len", type=int, help="generate: tokens per prompt (default 128"
                      " on a TPU, 16 elsewhere)")
  parser.add_argument("--record", nargs="?", const="docs/performance.md", default=None,
                      metavar="PATH", help="TPU: also write the tables into the performance"
                      " record (default PATH: docs/performance.md)")
  parser.add_argument("--chain", type=int, default=32, metavar="N",
                      help="TPU, causal_conv1d_gated_delta_rule: calls chained in one program"
                      " for the headline ms per call (default 32; 0: call by call only)")
  parser.add_argument("--no-parts", action="store_true",
                      help="TPU, causal_conv1d_gated_delta_rule: leave out the mixed specs"
                      " against their parts")
  parser.add_argument("--json-out", metavar="PATH",
                      help="TPU, causal_conv1d_gated_delta_rule: also write the report as JSON"
                      " to PATH, after every row (a run cut short keeps its rows)")
  parser.add_argument("--from-json", metavar="PATH,...",
                      help="causal_conv1d_gated_delta_rule: print (and --record) the tables of"
                      " reports saved with --json-out, measuring nothing")


def run(args) -> int:
  import jax  # pylint: disable=g-import-not-at-top
  if args.chain < 0:
    raise ValueError(f"--chain must be >= 0 (got {args.chain})")
  if args.from_json:
    if args.op != "causal_conv1d_gated_delta_rule":
      raise ValueError("--from-json takes reports of --op causal_conv1d_gated_delta_rule")
    return _serving_from_json(args)
  if args.op == "generate":
    from tokamax_gdn.cli import bench_chip  # pylint: disable=g-import-not-at-top
    on_tpu = jax.default_backend() == "tpu"
    args.reps = args.reps or (20 if on_tpu else 3)
    return bench_chip.generate(args, on_tpu)
  if jax.default_backend() == "tpu":
    from tokamax_gdn.cli import bench_chip  # pylint: disable=g-import-not-at-top
    tag = "aot" if args.op == "causal_conv1d_gated_delta_rule" and args.tag == "bench" else args.tag
    specs = (common.select_specs(args.op, args.specs, tag)
             if args.op == "causal_conv1d_gated_delta_rule" else [])
    args.reps = args.reps or 20
    return bench_chip.run(args, specs)
  args.reps = args.reps or 7
  specs = common.select_specs(args.op, args.specs, args.tag)
  run_op = dict(gated_delta_rule=_gdn, gmm=_gmm, causal_conv1d_gated_delta_rule=_serving)
  return run_op[args.op](args, specs)


def _mib(x) -> str | None:
  return None if x is None else f"{x / 2**20:.1f}"


def _ratio(x) -> str | None:
  return None if x is None else f"{x:.2f}x"


def _gdn(args, specs) -> int:
  from tokamax_gdn.benchmarks import gated_delta_rule as bench  # pylint: disable=g-import-not-at-top
  impls = [s for s in (args.impls or "reference,xla,xla_autodiff").split(",") if s]
  report = bench.run(specs, impls, args.reps)
  if args.json:
    common.print_json(report)
    return 0
  common.print_table(
      [dict(shape=r["shape"], impl=r["impl"], fwd=f"{r['fwd_ms']:.2f}",
            fwd_bwd=f"{r['fwd_bwd_ms']:.2f}", resid=_mib(r["residual_bytes"]),
            temp=_mib(r["temp_bytes"]), vs_ref=_ratio(r["speedup_vs_reference"]),
            vs_auto=_ratio(r["speedup_vs_autodiff"]),
            vs_flops=_ratio(r["fwd_bwd_over_flops_time"])) for r in report["rows"]],
      dict(shape="shape (B T Hk Hv K V)", impl="impl", fwd="fwd ms", fwd_bwd="fwd+bwd ms",
           resid="resid MiB", temp="temp MiB", vs_ref="vs ref", vs_auto="vs autodiff",
           vs_flops="vs FLOPs@mm"))
  print(f"f32 matmul throughput (best round): {report['matmul_flops'] / 1e9:.1f} GFLOP/s")
  for impl, sc in report["scaling"].items():
    print(f"{impl}: fwd+bwd T={sc['t_hi']} / T={sc['t_lo']} = {sc['fwd_bwd_ratio']:.2f}"
          f" (linear: {sc['t_hi'] / sc['t_lo']:.2f})")
  print("vs ref / vs autodiff: fwd+bwd speed-up (>1 = faster); resid: all arrays the VJP"
        " keeps for the backward, inputs included; temp: compiled fwd+bwd scratch;"
        " vs FLOPs@mm: fwd+bwd time over the essential FLOPs' time at the matmul throughput.")
  return 0


def _gmm(args, specs) -> int:
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import gmm as bench  # pylint: disable=g-import-not-at-top
  tiles = tuple(int(t) for t in args.tiles.split(",")) if args.tiles else None
  results = []
  for spec in specs:
    (lhs, rhs, gs), kwargs = spec.abstract()
    if kwargs.get("transpose_rhs"):
      print(f"skip {spec.name}: the gmm bench takes rhs [G, K, N]", file=sys.stderr)
      continue
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    dtype = jnp.dtype(lhs.dtype)
    rows = bench.run(args.target, m, k, n, g, dtype, tiles)
    results.append(dict(spec=spec.name, target=args.target, m=m, k=k, n=n, g=g,
                        dtype=dtype.name, rows=rows))
  if args.json:
    common.print_json(results)
    return 0
  fmt = lambda v, f: None if v is None else f.format(v)
  for res in results:
    common.print_table(
        [dict(kernel=r["kernel"], config=r["config"], steps=r["grid_steps"],
              cycles=fmt(r["cycles"], "{:,}"), fpc=fmt(r["flop_per_cycle"], "{:,.0f}"),
              dense=fmt(r["pct_dense"], "{:.0f}%"), bpf=f"{r['hbm_bytes_per_flop']:.4f}",
              note=r["note"]) for r in res["rows"]],
        dict(kernel="kernel", config="config", steps="grid steps", cycles="est. cycles",
             fpc="FLOP/cycle", dense="% dense", bpf="HBM B/FLOP", note="note"),
        title=f"{res['spec']}: gmm M={res['m']} K={res['k']} N={res['n']} G={res['g']}"
              f" {res['dtype']} on {res['target']} (AOT, static cycle estimates)")
  return 0


def _serving_from_json(args) -> int:
  import json  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.cli import bench_chip  # pylint: disable=g-import-not-at-top
  reports = []
  for path in [p for p in args.from_json.split(",") if p]:
    with open(path) as f:
      report = json.load(f)
    if not isinstance(report, dict) or "rows" not in report or "floors" not in report:
      raise ValueError(f"{path}: not a report of `bench --op {args.op} --json-out`")
    reports.append(report)
  bench_chip.print_serving(args, reports)
  return 0


def _serving(args, specs) -> int:
  from tokamax_gdn.benchmarks import serving as bench  # pylint: disable=g-import-not-at-top
  impls = [s for s in (args.impls or "xla").split(",") if s and s != bench.TOKAMAX]
  rows = bench.run(specs, (*impls, bench.TOKAMAX), args.reps)
  if args.json:
    common.print_json(rows)
    return 0
  common.print_table(
      [dict(spec=r["spec"], shape=r["shape"], impl=r["impl"], ms=(f"{r['ms']:.2f}" if r["ms"] is not None
                                                         else r["error"]),
            ratio=_ratio(r["tokamax_over_this"])) for r in rows],
      dict(spec="workload", shape="shape", impl="impl", ms="median ms",
           ratio="tokamax / this"))
  print("tokamax / this: tokamax's xla op time over this implementation's, same run"
        " (> 1: faster than tokamax).")
  return 0
