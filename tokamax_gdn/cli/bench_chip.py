"""`tokamax-gdn bench` on a TPU: wall-clock tables beside the chip's floors and
the peers that run there, all in one run (`tokamax_gdn.benchmarks.on_chip`).

Each table prints, goes out as JSON with --json, and with --record [PATH]
into its section of the performance record (docs/performance.md), stamped with
the date, the versions, the device and the command.

`--op generate` (`generate`) also runs off a TPU, at small sizes with the
`xla` implementation, so the command and its table can be checked anywhere;
its figures are then the CPU's, said so, and never recorded.
"""

import sys
import time
from typing import Any

from tokamax_gdn.cli import common

_GDN_COLUMNS = dict(t="T", impl="impl", pass_="pass", ms="ms", floor_ms="floor ms",
                    over_floor="x floor", over_peak_floor="x peak floor", mfu="MFU",
                    temp_mib="temp MiB", compile_s="compile s", error="error")
_FIXED_COLUMNS = dict(impl="impl", pass_="pass", intercept_ms="intercept ms",
                      ms_per_4096_tokens="ms / 4096 tokens", lengths="lengths")
_SERVING_COLUMNS = dict(spec="workload", impl="impl", floor_ms="floor ms", bound="bound",
                        chained_ms="chained ms/call", over_floor="x floor",
                        ms="ms/call (call by call)", device_ms="device ms",
                        device_over_floor="device x floor", compile_s="compile s",
                        chain_compile_s="chained compile s", loop_invariant="hoisted",
                        error="error")
_MIXED_COLUMNS = dict(spec="mixed workload", impl="impl", ms="ms", parts="parts",
                      parts_ms="parts ms (sum)", over_parts="x parts")
_GMM_COLUMNS = dict(op="op", shape="shape", impl="impl", ms="ms", floor_ms="floor ms",
                    over_floor="x floor", pct_of_dense="% of dense", error="error")
_GENERATION_COLUMNS = dict(impl="impl", batch="B", phase="phase", tokens="tokens / call",
                           ms="ms", tokens_per_s="tokens/s", device_ms="device ms",
                           floor_ms="HBM floor ms", over_floor="x floor",
                           device_over_floor="device x floor", gdn_share="GDN share",
                           matched="attributed", compile_s="compile s", error="error")
_PERCENT = ("mfu", "gdn_share", "matched")


_START = time.monotonic()


def _log(line: str) -> None:
  """Progress on stderr, stamped with the seconds since the command began: a
  row's compile on the chip can take a minute, and a run cut short by a time
  limit then shows whether its last row was slow or stuck."""
  print(f"[bench] {line} (+{time.monotonic() - _START:.0f} s)", file=sys.stderr, flush=True)


def _fmt(rows, columns) -> list[dict[str, Any]]:
  out = []
  for r in rows:
    row = {}
    for k in columns:
      v = r.get(k)
      if isinstance(v, float):
        v = f"{v:.1%}" if k in _PERCENT else f"{v:.4g}"
      elif isinstance(v, list):
        v = "; ".join(map(str, v)) or None
      row[k] = v
    out.append(row)
  return out


def _command() -> str:
  """The command line that produced this run's tables, as the record states it."""
  return "tokamax-gdn " + " ".join(a for a in sys.argv[1:] if a != "--json")


def _emit(args, name: str, title: str, rows, columns, floors_line: str, *,
          markdown: bool = False, command: str | None = None,
          device: str | None = None) -> None:
  """Prints a table (aligned, or as markdown) and the floors line; with
  --record, writes it into its section of the record (`command` and
  `device` as stated there: default this run's)."""
  from tokamax_gdn.benchmarks import record  # pylint: disable=g-import-not-at-top
  rows = _fmt(rows, columns)
  if markdown:
    print(title)
    print(record.markdown_table(rows, columns))
  else:
    common.print_table(rows, columns, title=title)
  if args.record:
    record.write_section(args.record, name, f"{title} (wall clock on the chip)",
                         command or _command(), rows, columns, device=device)
  print(floors_line)


def _floors_line(floors, trip: float, peak: bool = False) -> str:
  rates = "the published peaks" if peak and floors.peak_flops else "the measured rates"
  return (
      f"{floors.device_kind}: bf16 matmul {floors.mxu_flops / 1e12:.1f} TFLOP/s, HBM stream"
      f" {floors.hbm_bytes / 1e9:.0f} GB/s measured in this run (peaks"
      f" {(floors.peak_flops or 0) / 1e12:.0f} TFLOP/s, {(floors.peak_hbm or 0) / 1e9:.0f} GB/s);"
      f" floor = essential FLOPs or minimal HBM bytes at {rates}. Times are steady"
      f" state (the per-call slope between bursts of n and 2n calls issued back to back,"
      f" `timing.wall_ms`); a synchronous call adds the host round trip,"
      f" {trip:.3f} ms here.")


def run(args, specs) -> int:
  """The on-chip tables of --op."""
  from tokamax_gdn.benchmarks import on_chip  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import timing  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import workload  # pylint: disable=g-import-not-at-top
  floors = timing.measure_floors()
  trip = timing.round_trip_ms()
  floors_line = _floors_line(floors, trip)
  report: dict[str, Any] = dict(floors=floors.as_dict(), round_trip_ms=trip)
  if args.op == "gated_delta_rule":
    lengths = [int(t) for t in args.lengths.split(",")]
    shape = workload.LayerShape(b=1, t=lengths[0], hk=16, hv=32, k=128, v=128)
    impls = [s for s in (args.impls or f"{on_chip.PALLAS},xla").split(",") if s]
    rows = on_chip.gdn_rows(floors, shape, lengths, impls, n=args.reps, log=_log)
    fixed = on_chip.fixed_cost(rows)
    report.update(rows=rows, fixed_cost=fixed)
    if args.profile:
      report["profile"] = {t: on_chip.gdn_profile(shape, t) for t in lengths}
    if args.json:
      common.print_json(report)
      return 0
    _emit(args, "chip-gdn", f"gated_delta_rule, Qwen3-Next layer (B1 Hk16 Hv32 K=V=128 bf16)"
          f" on {floors.device_kind}", rows, _GDN_COLUMNS, floors_line)
    if fixed:
      common.print_table(_fmt(fixed, _FIXED_COLUMNS), _FIXED_COLUMNS,
                         title="fit ms = intercept + slope * T (per-call cost that does not scale)")
    for t, prof in report.get("profile", {}).items():
      for pass_, p in prof.items():
        ops = [dict(name=o["name"], thread=o["thread"], us=f"{o['us']:.1f}", count=o["count"])
               for o in p["ops"]]
        common.print_table(ops, title=f"T={t} {pass_}: wall {p['wall_ms']:.3f} ms, device"
                           f" ops {p['device_ms']:.3f} ms")
    return 0
  if args.op == "causal_conv1d_gated_delta_rule":
    return _serving(args, specs, floors, report)
  rows = on_chip.gmm_rows(floors, n=args.reps, log=_log)
  if args.json:
    common.print_json(report | dict(rows=rows))
    return 0
  _emit(args, "chip-gmm", f"gmm / tgmm, MoE shapes (bf16, 64 groups) on {floors.device_kind}",
        rows, _GMM_COLUMNS, floors_line)
  return 0


# Kernels and XLA ops listed per serving row under --profile.
_PROFILE_OPS = 12
# The serving bench's implementations: ours, then the peers
# (`benchmarks.serving.PEERS`).
SERVING_IMPLS = "pallas_mosaic_tpu,xla,tokamax_xla,vllm,vllm_dropin"


def _serving(args, specs, floors, report) -> int:
  """The serving op's tables (`on_chip.serving_rows`): every implementation
  on every spec, chained calls (--chain) beside the call-by-call and device
  times, then (unless --no-parts) the mixed specs against their parts.
  With --json-out the report is written there after every row."""
  import json  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import on_chip  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs  # pylint: disable=g-import-not-at-top
  impls = [s for s in (args.impls or SERVING_IMPLS).split(",") if s]
  report.update(command=_command(), chain=args.chain, rows=[], mixed=[])

  def save(row=None):
    if row is not None:
      report["rows"].append(row)
    if args.json_out:
      with open(args.json_out, "w") as f:
        json.dump(report, f, indent=1, default=str)

  on_chip.serving_rows(floors, [s.name for s in specs], impls, n=args.reps, log=_log,
                       ops=_PROFILE_OPS if args.profile else 0, pool_layout=args.pool_layout,
                       chain=args.chain, on_row=save)
  parts = {} if args.no_parts else arg_specs.PARTS
  report["mixed"] = on_chip.mixed_vs_parts(floors, report["rows"], parts, n=args.reps,
                                           log=_log, pool_layout=args.pool_layout,
                                           chain=args.chain)
  save()
  if args.json:
    common.print_json(report)
    return 0
  print_serving(args, [report])
  return 0


def print_serving(args, reports) -> None:
  """The serving tables of one or more reports (`_serving`'s JSON; several:
  one run split over calls, the rows in their order), printed and, with
  --record, recorded with the device and the commands that measured them:
  the chained-call table (one line per workload, markdown, the README's
  serving table), then every row, the profiles' ops, the mixed calls."""
  from tokamax_gdn.benchmarks import on_chip  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import timing  # pylint: disable=g-import-not-at-top
  floors = timing.Floors(**reports[0]["floors"])
  rows = [r for rep in reports for r in rep["rows"]]
  mixed = [r for rep in reports for r in rep.get("mixed", [])]
  command = " ; ".join(dict.fromkeys(rep["command"] for rep in reports))
  floors_line = _floors_line(floors, reports[0]["round_trip_ms"], peak=True)
  where = dict(command=command, device=floors.device_kind)
  chain = reports[0].get("chain")
  table, columns = on_chip.chained_table(rows)
  _emit(args, "chip-serving-chained",
        f"causal_conv1d_gated_delta_rule on {floors.device_kind}: ms per call, {chain} calls"
        " chained in one program (pools carried and donated), against the floor",
        table, columns, floors_line, markdown=True, **where)
  _emit(args, "chip-serving", f"causal_conv1d_gated_delta_rule on {floors.device_kind}",
        rows, _SERVING_COLUMNS, floors_line, **where)
  _print_ops(rows)
  if mixed:
    _emit(args, "chip-serving-mixed", "mixed serving calls against their parts run as"
          f" separate calls on {floors.device_kind}", mixed, _MIXED_COLUMNS, floors_line,
          **where)
  print("floor: the larger of the essential MXU FLOPs (the chunked algorithm at C = 64 over"
        " the valid tokens) and the minimal HBM bytes (states read and written, tokens in and"
        " out) at the chip's published peaks. chained: ms per call of N calls in one program"
        " (`lax.fori_loop`), the host's dispatch paid once per N; call by call: one program per"
        " call, issued back to back; device: the profile's busy time of one call. hoisted:"
        " work XLA moved out of the chained loop (none is right).")


def _print_ops(rows) -> None:
  """Each row's profile ops (`serving_rows(ops=...)`), where it has them."""
  for r in rows:
    if r.get("ops") is not None:
      ops = [dict(name=o["name"], thread=o["thread"], us=f"{o['us']:.1f}", count=o["count"])
             for o in r["ops"]]
      common.print_table(ops, title=f"{r['spec']} {r['impl']}: device ops {r['device_ms']:.3f} ms"
                                    " per call")


def generate(args, on_tpu: bool) -> int:
  """`models.generate`'s prefill and decode steps for --model at --batches
  (`benchmarks.generation`): on a TPU beside the chip's floors (--record
  writes "chip-generation"); elsewhere at small sizes, said to be CPU figures.

  Off a TPU the floors come from a small matmul and stream (an 8192³ bf16
  matmul would take minutes on a CPU) and the defaults shrink (batches 1,8,
  16-token prompts, `xla`): about a minute, most of it compiling the four steps.
  """
  from tokamax_gdn.benchmarks import generation  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import timing  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  cfg = ModelConfig.load(args.model or common.DEFAULT_MODEL)
  batches = [int(b) for b in (args.batches or ("1,8,64" if on_tpu else "1,8")).split(",") if b]
  impls = [s for s in (args.impls or (f"{generation.PALLAS},xla" if on_tpu else "xla")).split(",")
           if s]
  prompt_len = args.prompt_len or (128 if on_tpu else 16)
  if min(batches, default=0) < 1 or prompt_len < 1:
    raise ValueError("--batches and --prompt-len must be >= 1")
  if on_tpu:
    floors = timing.measure_floors()
  else:
    floors = timing.measure_floors(matmul_n=512, stream_bytes=1 << 26, n=3)
  trip = timing.round_trip_ms()
  rows = generation.generation_rows(floors, cfg, batches=batches, prompt_len=prompt_len,
                                    impls=impls, n=args.reps, log=_log)
  if args.json:
    common.print_json(dict(floors=floors.as_dict(), round_trip_ms=trip, model=cfg.name,
                           prompt_len=prompt_len, on_tpu=on_tpu, rows=rows))
    return 0
  title = (f"models.generate steps, {cfg.name} (prompts of {prompt_len} tokens; bf16 weights and"
           f" activations, f32 GDN states) on {floors.device_kind}")
  if not on_tpu:
    title += ": CPU figures, not the chip's"
    if args.record:
      print("--record: not written, these are CPU figures (the record holds the chip's).",
            file=sys.stderr)
      args.record = None
  _emit(args, "chip-generation", title, rows, _GENERATION_COLUMNS, _floors_line(floors, trip))
  print("prefill: one step over all B prompts; decode: one step of one token per request."
        " HBM floor (decode): the weights the step uses read once, each request's GDN states"
        " read and written, the KV cache read up to its length (benchmarks/generation.py)."
        " GDN share: the serving op's part of the step's device time (TPU profile);"
        " attributed: the part of it the profile's events could be traced to.")
  return 0
