"""`tokamax-gdn autotune`: tune an op's configs for a model's shapes.

  tokamax-gdn autotune --model configs/models/qwen3.5-tiny.yml --seq-len 8192 \
      [--op gated_delta_rule] [--impl xla] [--batch 1] [--dtype bfloat16] \
      [--hk 2 --hv 4 --k 128 --v 128] [--out result.json] [--install] [--json]

The inputs are those `GatedDeltaNet` passes the op (q, k, v, raw gate, beta in
the activation dtype; float32 `a_log`/`dt_bias`; `use_qk_l2norm=True`), so the
tuned entries are the ones the layer looks up. Both the forward Op (called
alone, and inside `jax.grad`, whose cache keys differ by `return_residuals`)
and its VJP Op are tuned. `--out` writes the `tokamax.AutotuningResult` JSON
(`AutotuningResult.loads` reads it back; usable as a context manager);
`--install` merges it into `tokamax_gdn/data/autotuning/<device>/<op>.json`,
which the ops read as their shipped autotuning cache.
"""

import argparse
from collections.abc import Sequence
import dataclasses
import json
import pathlib
import sys
import time
from typing import Any

import jax
from jax.extend import backend
import jax.numpy as jnp
import tqdm
from tokamax._src import benchmarking
from tokamax._src import hlo_utils
from tokamax._src.autotuning import api as autotuning_api
from tokamax._src.autotuning import autotuner as autotuner_lib
from tokamax._src.ops import op as op_lib

from tokamax_gdn import autotuning
from tokamax_gdn import registry

TUNABLE_OPS = ("gated_delta_rule",)


@dataclasses.dataclass(frozen=True)
class Shapes:
  b: int
  t: int
  hk: int
  hv: int
  k: int
  v: int
  dtype: Any

  def __str__(self):
    return (f"B{self.b} T{self.t} Hk{self.hk} Hv{self.hv} K{self.k} V{self.v}"
            f" {jnp.dtype(self.dtype).name}")


def _model_config(model: str):
  # Lazy: the layers package is only needed to read a preset.
  from tokamax_gdn.layers import presets  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig  # pylint: disable=g-import-not-at-top
  path = pathlib.Path(model)
  if path.is_file():
    return GatedDeltaNetConfig.from_yaml(path)
  # `configs/models/<name>.yml` outside a checkout: the preset shipped in the package.
  name = path.stem if path.suffix in (".yml", ".yaml") else model
  try:
    return presets.load_preset(name)
  except ValueError as e:
    raise SystemExit(f"error: {e}") from None


def _shapes(args) -> Shapes:
  base = {}
  if args.model:
    cfg = _model_config(args.model)
    base = dict(hk=cfg.num_k_heads, hv=cfg.num_v_heads, k=cfg.head_k_dim, v=cfg.head_v_dim)
  for name in ("hk", "hv", "k", "v"):
    if getattr(args, name) is not None:
      base[name] = getattr(args, name)
  missing = [n for n in ("hk", "hv", "k", "v") if n not in base]
  if missing:
    raise SystemExit(f"error: give --model or all of --hk --hv --k --v (missing {missing})")
  return Shapes(b=args.batch, t=args.seq_len, dtype=jnp.dtype(args.dtype), **base)


def gdn_inputs(s: Shapes) -> tuple[tuple[jax.ShapeDtypeStruct, ...], dict[str, Any]]:
  """Abstract inputs of the `gated_delta_rule` call `GatedDeltaNet` makes."""
  sds = jax.ShapeDtypeStruct
  args = (
      sds((s.b, s.t, s.hk, s.k), s.dtype), sds((s.b, s.t, s.hk, s.k), s.dtype),
      sds((s.b, s.t, s.hv, s.v), s.dtype), sds((s.b, s.t, s.hv), s.dtype),
      sds((s.b, s.t, s.hv), s.dtype),
      sds((s.hv,), jnp.float32), sds((s.hv,), jnp.float32),
  )
  return args, dict(use_qk_l2norm=True)


def _gdn_fns(impl: str):
  from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule  # pylint: disable=g-import-not-at-top

  def fwd(q, k, v, g, beta, a_log, dt_bias):
    return gated_delta_rule(q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
                            use_qk_l2norm=True, implementation=impl)[0]

  def loss(*xs):
    return jnp.sum(fwd(*xs).astype(jnp.float32))

  return fwd, jax.grad(loss, argnums=tuple(range(7)))


def bound_args(op_name: str, impl: str, s: Shapes, *, backward: bool = True):
  """[(label, BoundArguments)] of the tunable Ops a forward (and grad) call makes."""
  if op_name != "gated_delta_rule":
    raise SystemExit(f"error: autotune supports --op {', '.join(TUNABLE_OPS)}; got {op_name!r}")
  args, _ = gdn_inputs(s)
  fwd, grad = _gdn_fns(impl)
  found = [("fwd", ba) for ba in hlo_utils.get_bound_args(fwd, *args)]
  if backward:
    for ba in hlo_utils.get_bound_args(grad, *args):
      found.append(("vjp" if ba.op is not None and "Vjp" in type(ba.op).__name__
                    else "fwd (in grad)", ba))
  out, seen = [], set()
  for label, ba in found:
    if type(ba.op).config_cls is op_lib.NullConfig:
      continue
    key = (ba.op.replace(config=None, vjp=None), ba.autotuning_cache_key)
    if key not in seen:
      seen.add(key)
      out.append((label, ba))
  return out


def _median(bench) -> float:
  return bench.median_evaluation_time_ms


def _config_str(cfg) -> str:
  if dataclasses.is_dataclass(cfg):
    return ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))
  return str(cfg)


def tune(
    items: Sequence[tuple[str, op_lib.BoundArguments]],
    *,
    timeout: float | None = 600.0,
    progress: bool = True,
) -> autotuning_api.AutotuningResult:
  """Benchmarks every autotuning config of every bound op, one config at a time."""
  jobs = [(i, cfg) for i, (_, ba) in enumerate(items) for cfg in ba.autotuning_configs]
  per_item: list[dict] = [{} for _ in items]
  # One compile at a time: compiles compete for the cores timings run on.
  tuner = autotuner_lib.Autotuner(compile_executor_fn=None)
  bar = tqdm.tqdm(jobs, desc="Autotuning", unit=" config", disable=not progress,
                  file=sys.stderr)
  for i, cfg in bar:
    label, ba = items[i]
    bar.set_postfix_str(f"{type(ba.op).__name__} {label} {_config_str(cfg)}")
    data = ba.autotune({cfg}, autotuner=tuner, cache_results=False, timeout=timeout)
    per_item[i].update(data)
  kind = backend.get_default_device().device_kind
  data = tuple((ba, autotuner_lib.AutotuningData(d)) for (_, ba), d in zip(items, per_item))
  return autotuning_api.AutotuningResult(kind, data)


def table_rows(items, result, op_name: str, impl: str, shapes: Shapes) -> list[dict[str, Any]]:
  rows = []
  for (label, ba), (_, data) in zip(items, result.data):
    ok = {c: b for c, b in data.items() if isinstance(b, benchmarking.BenchmarkData)}
    row = dict(op=op_name, implementation=impl, op_class=type(ba.op).__name__,
               pass_=label, shape=str(shapes))
    if not ok:
      row.update(best_config=None, median_ms=None, heuristics_config=None,
                 heuristics_ms=None, speedup=None,
                 error="; ".join(repr(e)[:200] for e in data.values()))
    else:
      best = data.fastest_config
      heur = ba.heuristics_config
      heur_ms = _median(ok[heur]) if heur in ok else None
      best_ms = _median(ok[best])
      row.update(best_config=_config_str(best), median_ms=round(best_ms, 4),
                 heuristics_config=_config_str(heur),
                 heuristics_ms=None if heur_ms is None else round(heur_ms, 4),
                 speedup=None if heur_ms is None else round(heur_ms / best_ms, 3),
                 all_ms={_config_str(c): round(_median(b), 4) for c, b in ok.items()})
    rows.append(row)
  return rows


def format_table(rows: list[dict[str, Any]]) -> str:
  head = ("op", "impl", "pass", "shape", "best config", "median ms",
          "heuristics", "heur. ms", "speedup")
  body = [(r["op"], r["implementation"], r["pass_"], r["shape"], str(r["best_config"]),
           "-" if r["median_ms"] is None else f"{r['median_ms']:.3f}",
           str(r["heuristics_config"]),
           "-" if r["heuristics_ms"] is None else f"{r['heuristics_ms']:.3f}",
           "-" if r["speedup"] is None else f"{r['speedup']:.2f}x") for r in rows]
  widths = [max(len(x) for x in col) for col in zip(head, *body)]
  line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, body)])


def _default_impls(op_name: str) -> list[str]:
  impls = registry.implementations(op_name)
  return [n for n in registry.default_order(op_name)
          if type(impls[n]).config_cls is not op_lib.NullConfig]


def build_parser(prog: str = "tokamax-gdn autotune") -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
  p.add_argument("--model", help="configs/models/<preset>.yml, or a preset name")
  p.add_argument("--seq-len", "-T", type=int, required=True, help="tokens per sequence")
  p.add_argument("--op", action="append", choices=TUNABLE_OPS,
                 help="op to tune (repeatable; default gated_delta_rule)")
  p.add_argument("--impl", action="append",
                 help="implementation (repeatable; default: the backend's tunable ones)")
  p.add_argument("--batch", "-B", type=int, default=1)
  p.add_argument("--dtype", default="bfloat16", help="activation dtype (default bfloat16)")
  p.add_argument("--hk", type=int, help="key heads (overrides the model)")
  p.add_argument("--hv", type=int, help="value heads (overrides the model)")
  p.add_argument("--k", type=int, help="key head dim (overrides the model)")
  p.add_argument("--v", type=int, help="value head dim (overrides the model)")
  p.add_argument("--forward-only", action="store_true", help="skip the VJP ops")
  p.add_argument("--timeout", type=float, default=600.0, help="compile timeout per config (s)")
  p.add_argument("--out", help="write the AutotuningResult JSON here")
  p.add_argument("--install", action="store_true",
                 help="merge the result into tokamax_gdn/data/autotuning (shipped cache)")
  p.add_argument("--install-dir", help="with --install: another root instead of the package's")
  p.add_argument("--json", action="store_true", help="print the table as JSON")
  p.add_argument("--no-progress", action="store_true")
  return p


def main(argv: list[str] | None = None) -> int:
  args = build_parser().parse_args(argv)
  if args.seq_len <= 0 or args.batch <= 0:
    raise SystemExit("error: --seq-len and --batch must be positive")
  shapes = _shapes(args)
  results, rows = [], []
  start = time.perf_counter()
  for op_name in args.op or ["gated_delta_rule"]:
    impls = args.impl or _default_impls(op_name)
    known = registry.implementations(op_name)
    for impl in impls:
      if impl not in known:
        raise SystemExit(f"error: no implementation {impl!r} of {op_name}; have {', '.join(known)}")
      items = bound_args(op_name, impl, shapes, backward=not args.forward_only)
      if not items:
        print(f"{op_name}/{impl}: nothing tunable (no Config)", file=sys.stderr)
        continue
      result = tune(items, timeout=args.timeout, progress=not args.no_progress)
      results.append(result)
      rows += table_rows(items, result, op_name, impl, shapes)
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
    print(json.dumps(dict(device_kind=merged.device_kind, seconds=round(elapsed, 1),
                          rows=rows, written=written), indent=2))
  else:
    print(f"device: {merged.device_kind}   ({elapsed:.0f} s)")
    print(format_table(rows))
    for w in written:
      print(f"wrote {w}")
  return 0 if all(r["best_config"] is not None for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
