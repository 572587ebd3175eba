"""Benchmark of the gated delta rule implementations (forward, forward+backward).

`run(specs, impls, reps)` times, per spec (the op's `arg_specs` tagged
'bench' by default) and implementation, the median forward and
forward+backward (gradients of <out, random cotangent> for q, k, v, g, beta),
and measures the bytes the VJP keeps for the backward (every array held by
`jax.vjp`'s closure, inputs included) and the compiled fwd+bwd temp bytes.
Ratios are against `reference` and against `xla_autodiff` (the `xla` chunked
forward differentiated by JAX autodiff instead of its analytical VJP), all
measured in the same run: every row and a 1024^3 f32 matmul are timed once
per round (after an untimed warm call each), `reps` rounds, medians reported
(`reference` rows in rounds of their own). Also: the fwd+bwd time over the
time the essential FLOPs (`workload.essential_flops`, chunk 64) take at the
matmul's best-round throughput, and per implementation the largest-T over
smallest-T time ratio of rows that differ only in T.
"""

from collections.abc import Sequence
import dataclasses
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.benchmarks import workload

OP = "gated_delta_rule"
AUTODIFF = "xla_autodiff"
REFERENCE_MAX_T = 2048


def known_implementations() -> set[str]:
  return set(registry.implementations(OP)) | {AUTODIFF}


def _impl(name: str):
  if name == AUTODIFF:
    return registry.get(OP, "xla").replace(vjp=None)
  return name


def _time_ms(fn, args) -> float:
  """One call, timed after an untimed one (caches warm for this function)."""
  import time  # pylint: disable=g-import-not-at-top
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t0) * 1e3


@dataclasses.dataclass
class _Case:
  spec: str
  impl: str
  shape: workload.LayerShape
  fns: dict[str, Any]
  args: tuple[Any, ...]
  residual_bytes: int
  temp_bytes: int | None
  input_bytes: int
  times: dict[str, list[float]] = dataclasses.field(
      default_factory=lambda: dict(fwd=[], fwd_bwd=[]))


def _case(spec, name: str, key) -> _Case:
  """Compiled and warmed-up forward and forward+backward of one row, with its memory."""
  args, kwargs = spec.make(key)
  impl = _impl(name)
  out_shape = jax.eval_shape(lambda *a: tokamax_gdn.gated_delta_rule(
      *a, **kwargs, implementation=impl)[0], *args)
  cot = jax.random.normal(jax.random.fold_in(key, 1), out_shape.shape, jnp.float32)

  def fwd(*a):
    return tokamax_gdn.gated_delta_rule(*a, **kwargs, implementation=impl)[0]

  def loss(*a):
    return jnp.sum(fwd(*a).astype(jnp.float32) * cot)

  fwd_jit = jax.jit(fwd)
  # Compiled once: the executable both runs and reports its memory.
  fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=range(5))).lower(*args).compile()
  for fn in (fwd_jit, fwd_bwd):
    jax.block_until_ready(fn(*args))  # compile + warm-up
  # The residuals the VJP keeps, from shapes alone (no compile, no run).
  f_vjp = jax.eval_shape(lambda *a: jax.vjp(jax.jit(fwd), *a)[1], *args)
  resid = sum(x.size * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(f_vjp)
              if isinstance(x, jax.ShapeDtypeStruct))
  mem = fwd_bwd.memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  return _Case(spec=spec.name, impl=name, shape=workload.layer_shape(args),
               fns=dict(fwd=fwd_jit, fwd_bwd=fwd_bwd), args=args, residual_bytes=int(resid),
               temp_bytes=temp, input_bytes=sum(x.nbytes for x in args))


def _matmul(n: int = 1024):
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
  b = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
  mm = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
  jax.block_until_ready(mm(a, b))
  return mm, (a, b), 2 * n**3


def _measure_interleaved(cases: Sequence[_Case], reps: int) -> float:
  """Times every case (and the matmul) once per round, `reps` rounds; returns
  the best matmul FLOP/s.

  Interleaving keeps the ratios between rows (and against the matmul rate)
  honest on a machine whose speed drifts with other load.
  """
  mm, mm_args, mm_flop = _matmul()
  mm_ms = []
  for _ in range(reps):
    mm_ms.append(_time_ms(mm, mm_args))
    for case in cases:
      for key, fn in case.fns.items():
        case.times[key].append(_time_ms(fn, case.args))
  # The matmul's best round: the machine's throughput at its least disturbed,
  # which makes "fwd+bwd over the matmul time" a conservative ratio.
  return mm_flop / (min(mm_ms) / 1e3)


def run(specs, impls: Sequence[str], reps: int = 7, seed: int = 0,
        reference_max_t: int = REFERENCE_MAX_T) -> dict[str, Any]:
  """Benchmarks `impls` on every ArgSpec in `specs` (module docstring); `reference`
  only on specs of at most `reference_max_t` tokens.

  Returns dict(device, matmul_flops, reps, rows, scaling): one row per (spec,
  implementation) with times in ms and bytes, and per implementation the
  largest-T / smallest-T fwd+bwd time ratio with those T.
  """
  bad = sorted(set(impls) - known_implementations())
  if bad:
    raise ValueError(f"unknown implementation(s) {bad}; valid: {sorted(known_implementations())}")
  key = jax.random.key(seed)
  cases = []
  for spec in specs:
    t = workload.layer_shape(spec.abstract()[0]).t
    for name in impls:
      if name != "reference" or t <= reference_max_t:
        cases.append(_case(spec, name, key))
  # The reference's per-token scan allocates ~1.7 GiB per call at T=2048,
  # which disturbs whatever runs next: it gets rounds of its own.
  flops = _measure_interleaved([c for c in cases if c.impl != "reference"], reps)
  _measure_interleaved([c for c in cases if c.impl == "reference"], reps)

  rows = []
  for c in cases:
    essential = workload.essential_flops(c.shape, workload.FLOPS_CHUNK, backward=True)
    rows.append(dict(spec=c.spec, shape=str(c.shape), t=c.shape.t, impl=c.impl,
                     fwd_ms=statistics.median(c.times["fwd"]),
                     fwd_bwd_ms=statistics.median(c.times["fwd_bwd"]),
                     residual_bytes=c.residual_bytes, temp_bytes=c.temp_bytes,
                     input_bytes=c.input_bytes,
                     fwd_bwd_over_flops_time=statistics.median(c.times["fwd_bwd"])
                     / (essential / flops * 1e3)))
  by_spec = {(r["spec"], r["impl"]): r for r in rows}
  for r in rows:
    for other, col in (("reference", "speedup_vs_reference"), (AUTODIFF, "speedup_vs_autodiff")):
      base = by_spec.get((r["spec"], other))
      r[col] = base["fwd_bwd_ms"] / r["fwd_bwd_ms"] if base else None

  scaling = {}
  for c in cases:
    same = [d for d in cases if d.impl == c.impl
            and dataclasses.replace(d.shape, t=0) == dataclasses.replace(c.shape, t=0)]
    lo, hi = min(same, key=lambda d: d.shape.t), max(same, key=lambda d: d.shape.t)
    if hi.shape.t > lo.shape.t and c is hi:
      ms = lambda d: by_spec[(d.spec, d.impl)]["fwd_bwd_ms"]
      scaling[c.impl] = dict(t_lo=lo.shape.t, t_hi=hi.shape.t, fwd_bwd_ratio=ms(hi) / ms(lo))
  return dict(device=jax.devices()[0].device_kind, matmul_flops=flops, reps=reps,
              rows=rows, scaling=scaling)
