"""Autotuning an op's configs for the calls a model makes (`tokamax-gdn autotune`).

The tuning run, beside the benchmarks it is one of: it reads the registry and
the GDN workload, which `tokamax_gdn.autotuning` (the cache every op imports)
must not.

`bound_args(op, impl, shape)` finds the tunable Ops (those with a Config) that
the layer's call (`benchmarks.workload`) makes: the forward Op called
alone, the forward inside `jax.grad` (its cache key differs by
`return_residuals`) and the VJP Op. `tune(items)` benchmarks every autotuning
config of each, one config at a time, into a `tokamax.AutotuningResult`
(`autotuning.install` ships it; `AutotuningResult.dumps` saves it);
`table_rows` summarises it.
"""

from collections.abc import Callable, Sequence
import dataclasses
import sys
from typing import Any

from jax.extend import backend
from tokamax._src import benchmarking
from tokamax._src import hlo_utils
from tokamax._src.autotuning import api as autotuning_api
from tokamax._src.autotuning import autotuner as autotuner_lib
from tokamax._src.ops import op as op_lib

from tokamax_gdn import progress as progress_lib
from tokamax_gdn import registry
from tokamax_gdn.benchmarks import workload

TUNABLE_OPS = ("gated_delta_rule",)


def bound_args(op_name: str, impl: str, shape: workload.LayerShape, *, backward: bool = True
               ) -> list[tuple[str, op_lib.BoundArguments]]:
  """[(label, BoundArguments)] of the tunable Ops a forward (and grad) call makes."""
  if op_name not in TUNABLE_OPS:
    raise ValueError(f"autotuning supports the ops {', '.join(TUNABLE_OPS)}; got {op_name!r}")
  args = workload.abstract_inputs(shape)
  fwd, grad = workload.layer_fns(shape, impl)
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


def tunable_implementations(op_name: str) -> list[str]:
  """The backend's default implementations of `op_name` that have a Config."""
  impls = registry.implementations(op_name)
  return [n for n in registry.default_order(op_name)
          if type(impls[n]).config_cls is not op_lib.NullConfig]


def config_str(cfg) -> str:
  if dataclasses.is_dataclass(cfg):
    return ", ".join(f"{f.name}={getattr(cfg, f.name)}" for f in dataclasses.fields(cfg))
  return str(cfg)


def config_filter(only: Sequence[str]) -> Callable[[Any], bool] | None:
  """A predicate from `--only FIELD=V1,V2` terms: a config passes when each
  FIELD's value, printed, is one of its values. Unknown fields are errors."""
  terms = []
  for term in only:
    field, sep, values = term.partition("=")
    if not sep or not field or not values:
      raise ValueError(f"--only takes FIELD=V1,V2; got {term!r}")
    terms.append((field.strip(), {v.strip() for v in values.split(",")}))
  if not terms:
    return None

  def keep(cfg) -> bool:
    for field, values in terms:
      if not hasattr(cfg, field):
        names = [f.name for f in dataclasses.fields(cfg)] if dataclasses.is_dataclass(cfg) else []
        raise ValueError(f"--only {field}=...: {type(cfg).__name__} has no field {field!r};"
                         f" its fields: {', '.join(names)}")
      if str(getattr(cfg, field)) not in values:
        return False
    return True

  return keep


def tune(
    items: Sequence[tuple[str, op_lib.BoundArguments]],
    *,
    timeout: float | None = 600.0,
    progress: bool = True,
    keep: Callable[[Any], bool] | None = None,
) -> autotuning_api.AutotuningResult:
  """Benchmarks the autotuning configs of every bound op, one config at a time:
  all of them, or those `keep` accepts plus the heuristics' config."""
  jobs = [(i, cfg) for i, (_, ba) in enumerate(items) for cfg in ba.autotuning_configs
          if keep is None or keep(cfg) or cfg == ba.heuristics_config]
  per_item: list[dict] = [{} for _ in items]
  # One compile at a time: compiles compete for the cores timings run on.
  tuner = autotuner_lib.Autotuner(compile_executor_fn=None)
  bar = progress_lib.bar(jobs, desc="Autotuning", unit=" config", disable=not progress,
                         file=sys.stderr)
  for i, cfg in bar:
    label, ba = items[i]
    bar.set_postfix_str(f"{type(ba.op).__name__} {label} {config_str(cfg)}")
    data = ba.autotune({cfg}, autotuner=tuner, cache_results=False, timeout=timeout)
    per_item[i].update(data)
    if progress:  # each timing as it lands: a run cut short still says what it found
      for c, bench in data.items():
        got = (f"{bench.median_evaluation_time_ms:.4f} ms"
               if isinstance(bench, benchmarking.BenchmarkData) else repr(bench)[:200])
        bar.write(f"[autotune] {type(ba.op).__name__} {label} {config_str(c)}: {got}",
                  file=sys.stderr)
  kind = backend.get_default_device().device_kind
  data = tuple((ba, autotuner_lib.AutotuningData(d)) for (_, ba), d in zip(items, per_item))
  return autotuning_api.AutotuningResult(kind, data)


def table_rows(items, result, op_name: str, impl: str, shape: workload.LayerShape
               ) -> list[dict[str, Any]]:
  """One row per tuned Op: best config and median ms, the heuristics', the speedup."""
  median = lambda bench: bench.median_evaluation_time_ms
  rows = []
  for (label, ba), (_, data) in zip(items, result.data):
    ok = {c: b for c, b in data.items() if isinstance(b, benchmarking.BenchmarkData)}
    row = dict(op=op_name, implementation=impl, op_class=type(ba.op).__name__,
               pass_=label, shape=str(shape))
    if not ok:
      row.update(best_config=None, median_ms=None, heuristics_config=None,
                 heuristics_ms=None, speedup=None,
                 error="; ".join(repr(e)[:200] for e in data.values()))
    else:
      best = data.fastest_config
      heur = ba.heuristics_config
      heur_ms = median(ok[heur]) if heur in ok else None
      best_ms = median(ok[best])
      row.update(best_config=config_str(best), median_ms=round(best_ms, 4),
                 heuristics_config=config_str(heur),
                 heuristics_ms=None if heur_ms is None else round(heur_ms, 4),
                 speedup=None if heur_ms is None else round(heur_ms / best_ms, 3),
                 all_ms={config_str(c): round(median(b), 4) for c, b in ok.items()})
    rows.append(row)
  return rows
