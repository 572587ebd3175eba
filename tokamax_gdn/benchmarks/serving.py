"""CPU timings of the serving op: ours against tokamax's `xla` op, same run.

`run(specs, impls, reps)` (`tokamax-gdn bench --op causal_conv1d_gated_delta_rule`).
Every implementation is jitted with both pools donated and fed back (the way
an engine calls it: each call updates the pools the next one reads), on the
same inputs; rounds are interleaved (one call of each per round) so that load
on the machine hits all alike; the median round time is reported with the
ratio tokamax / ours (> 1: ours is faster). tokamax's `xla` is its reference
(`tokamax._src.ops.causal_conv1d_gated_delta_rule.api.IMPLEMENTATIONS["xla"]`:
a per-token scan over the pool).
"""

import statistics
import time
from typing import Any

import jax
from jax.experimental.layout import Format, Layout

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

OP = "causal_conv1d_gated_delta_rule"
TOKAMAX = "tokamax_xla"


def _tokamax_xla():
  from tokamax._src.ops.causal_conv1d_gated_delta_rule import api as tokamax_api  # pylint: disable=g-import-not-at-top
  return tokamax_api.IMPLEMENTATIONS["xla"]


# Pool layouts a benchmark may ask for: "auto" lets XLA pick the pools'
# layouts for the program (`Layout.AUTO`), and the caller places its pools in
# them once (`jax.device_put(pool, compiled.input_formats...)`), as an engine
# that allocates its pools for its compiled step does; "default" keeps the
# runtime's default layout at the jit boundary. On a TPU the default layout
# of a [slots, W-1, D] bf16 conv pool puts the W-1 axis outermost, and a
# kernel that reads the pool row-major then costs an XLA relayout of the
# whole pool into the call and back out of it.
POOL_LAYOUTS = ("auto", "default")


def check_pool_layout(pool_layout: str) -> None:
  if pool_layout not in POOL_LAYOUTS:
    raise ValueError(f"pool_layout={pool_layout!r}; valid: {POOL_LAYOUTS}")


def jitted_step(impl, kwargs, pool_layout: str = "default"):
  """The op as an engine's step: both pools donated and returned. With
  `pool_layout` "auto" the pools' layouts are XLA's choice for the program
  (lower and compile it, then place the pools in `input_formats`)."""
  check_pool_layout(pool_layout)
  static = {k: v for k, v in kwargs.items() if k in arg_specs.STATIC}
  if impl == TOKAMAX:
    op = _tokamax_xla()
    static.pop("num_spec_tokens", None) if not static.get("num_spec_tokens") else None
  else:
    op = registry.get(OP, impl)

  def step(conv, rec, rest, kw):
    return op(*rest[:3], conv, rec, *rest[3:], **kw, **static)

  if pool_layout == "default":
    return jax.jit(step, donate_argnums=(0, 1))
  auto = Format(Layout.AUTO)
  return jax.jit(step, donate_argnums=(0, 1), in_shardings=(auto, auto, None, None),
                 out_shardings=((auto, auto), None))


def describe(spec) -> str:
  (qkv, *_), kwargs = spec.abstract()
  return (f"T={qkv.shape[0]} Hk={kwargs['n_kq']} Hv={kwargs['n_v']} K={kwargs['d_k']}"
          f" V={kwargs['d_v']} {qkv.dtype}")


def run(specs, impls=("xla", TOKAMAX), reps: int = 5, key=None) -> list[dict[str, Any]]:
  """One row per (spec, implementation): median ms and tokamax's time / this one's."""
  key = jax.random.key(0) if key is None else key
  rows = []
  for spec in specs:
    args, kwargs = spec.make(key)
    arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
    rest = args[:3] + args[5:]
    fns = {impl: jitted_step(impl, kwargs) for impl in impls}
    pools = {impl: None for impl in impls}
    times = {impl: [] for impl in impls}
    for rnd in range(reps + 1):          # round 0 compiles
      for impl, fn in fns.items():
        if pools[impl] is None:
          pools[impl] = (args[3].copy(), args[4].copy())
        start = time.perf_counter()
        pools[impl], out = fn(*pools[impl], rest, arrays)
        jax.block_until_ready((pools[impl], out))
        if rnd:
          times[impl].append(time.perf_counter() - start)
    med = {impl: statistics.median(t) * 1e3 for impl, t in times.items()}
    for impl in impls:
      rows.append(dict(spec=spec.name, shape=describe(spec), impl=impl, ms=med[impl],
                       tokamax_over_this=(med[TOKAMAX] / med[impl] if TOKAMAX in med
                                          else None)))
  return rows
