"""Benchmark of the gated delta rule implementations (forward, forward+backward).

  tokamax-gdn bench --op gated_delta_rule [--seq-lens 2048,8192] [--impls ...]

Prints one table: per shape and implementation, the median forward and
forward+backward times, the bytes the VJP keeps for the backward (every
array held by `jax.vjp`'s closure, inputs included) and the compiled fwd+bwd
temp bytes, and speed ratios against `reference` and against `xla_autodiff`
(the `xla` chunked forward differentiated by JAX autodiff instead of its
analytical VJP), all measured in the same run: every row and a 1024^3 f32
matmul are timed once per round (after an untimed warm call each), `--reps`
rounds, medians reported (`reference` rows in rounds of their own). Below
the table: the matmul throughput (its best round), the fwd+bwd time over the
time 640 KFLOP per token per head would take at that throughput, and the
largest-T / smallest-T time ratio.
"""

import argparse
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import tokamax_gdn
from tokamax_gdn import registry

OP = "gated_delta_rule"
AUTODIFF = "xla_autodiff"
B, HK, HV, DK, DV = 1, 2, 4, 128, 128
FLOP_PER_TOKEN_HEAD = 640e3
REFERENCE_MAX_T = 2048


def _inputs(t: int, seed: int = 0):
  rng = np.random.default_rng(seed)
  normal = lambda *s: rng.standard_normal(s).astype(np.float32)
  q = normal(B, t, HK, DK)
  k = normal(B, t, HK, DK) * DK**-0.5
  v = normal(B, t, HV, DV)
  g = -np.logaddexp(0.0, normal(B, t, HV)) * 0.5
  beta = 1.0 / (1.0 + np.exp(-normal(B, t, HV)))
  cot = normal(B, t, HV, DV)
  return tuple(map(jnp.asarray, (q, k, v, g, beta))), jnp.asarray(cot)


def _impl(name: str):
  if name == AUTODIFF:
    return registry.get(OP, "xla").replace(vjp=None)
  return name


def _time_ms(fn, args) -> float:
  """One call, timed after an untimed one (caches warm for this function)."""
  jax.block_until_ready(fn(*args))
  t0 = time.perf_counter()
  jax.block_until_ready(fn(*args))
  return (time.perf_counter() - t0) * 1e3


def _case(name: str, t: int) -> dict:
  """Compiled and warmed-up forward and forward+backward of one row, with
  its memory figures."""
  args, cot = _inputs(t)
  impl = _impl(name)

  def fwd(*a):
    return tokamax_gdn.gated_delta_rule(*a, implementation=impl)[0]

  def loss(*a):
    return jnp.sum(fwd(*a).astype(jnp.float32) * cot)

  fwd_jit = jax.jit(fwd)
  fwd_bwd = jax.jit(jax.value_and_grad(loss, argnums=range(5)))
  for fn in (fwd_jit, fwd_bwd):
    jax.block_until_ready(fn(*args))  # compile + warm-up
    jax.block_until_ready(fn(*args))
  _, f_vjp = jax.vjp(jax.jit(fwd), *args)
  resid = sum(x.nbytes for x in jax.tree.leaves(f_vjp) if isinstance(x, jax.Array))
  mem = fwd_bwd.lower(*args).compile().memory_analysis()
  temp = getattr(mem, "temp_size_in_bytes", None) if mem is not None else None
  return dict(impl=name, t=t, fns=dict(fwd=fwd_jit, fwd_bwd=fwd_bwd), args=args,
              residual_bytes=int(resid), temp_bytes=temp,
              input_bytes=sum(x.nbytes for x in args))


def _matmul_fn(n: int = 1024):
  rng = np.random.default_rng(1)
  a = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
  b = jnp.asarray(rng.standard_normal((n, n)).astype(np.float32))
  mm = jax.jit(lambda x, y: jnp.matmul(x, y, precision=jax.lax.Precision.HIGHEST))
  jax.block_until_ready(mm(a, b))
  return mm, (a, b), 2 * n**3


def _measure_interleaved(cases: list[dict], reps: int) -> float:
  """Times every case (and the matmul) once per round, `reps` rounds; sets each
  case's median `fwd_ms` / `fwd_bwd_ms` and returns the best matmul FLOP/s.

  Interleaving keeps the ratios between rows (and against the matmul rate)
  honest on a machine whose speed drifts with other load.
  """
  mm, mm_args, mm_flop = _matmul_fn()
  times = [dict(fwd=[], fwd_bwd=[]) for _ in cases]
  mm_ms = []
  for _ in range(reps):
    mm_ms.append(_time_ms(mm, mm_args))
    for case, tms in zip(cases, times):
      for key, fn in case["fns"].items():
        tms[key].append(_time_ms(fn, case["args"]))
  for case, tms in zip(cases, times):
    case["fwd_ms"] = statistics.median(tms["fwd"])
    case["fwd_bwd_ms"] = statistics.median(tms["fwd_bwd"])
  # The matmul's best round: the machine's throughput at its least disturbed,
  # which makes "fwd+bwd over the matmul time" a conservative ratio.
  return mm_flop / (min(mm_ms) / 1e3)


def _mib(x) -> str:
  return "-" if x is None else f"{x / 2**20:.1f}"


def _ratio(x, y) -> str:
  return "-" if x is None or y is None else f"{x / y:.2f}x"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="tokamax-gdn bench --op gated_delta_rule",
                                   description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", default="2048,8192",
                      help="comma-separated T values (default 2048,8192)")
  parser.add_argument("--impls", default=f"reference,xla,{AUTODIFF}",
                      help=f"comma-separated implementations; '{AUTODIFF}' is"
                      " xla's forward under JAX autodiff; reference runs only"
                      f" for T <= {REFERENCE_MAX_T}")
  parser.add_argument("--reps", type=int, default=7, help="timed rounds (median)")
  parser.add_argument("--json", metavar="PATH", help="also write rows as JSON")
  args = parser.parse_args(argv)
  seq_lens = [int(s) for s in args.seq_lens.split(",") if s]
  impls = [s for s in args.impls.split(",") if s]
  known = set(registry.implementations(OP)) | {AUTODIFF}
  if bad := [i for i in impls if i not in known]:
    parser.error(f"unknown implementation(s) {bad}; valid: {sorted(known)}")

  cases = []
  for t in seq_lens:
    for name in impls:
      if name == "reference" and t > REFERENCE_MAX_T:
        continue
      try:
        cases.append(_case(name, t))
      except NotImplementedError as e:
        print(f"skip {name} T={t}: {e}", file=sys.stderr)
  # The reference's per-token scan allocates ~1.7 GiB per call at T=2048,
  # which disturbs whatever runs next: it gets rounds of its own.
  flops = _measure_interleaved([c for c in cases if c["impl"] != "reference"], args.reps)
  _measure_interleaved([c for c in cases if c["impl"] == "reference"], args.reps)
  rows = [{k: v for k, v in c.items() if k not in ("fns", "args")} for c in cases]

  by = {(r["impl"], r["t"]): r for r in rows}
  header = (f"{'shape (B,T,Hk,Hv,K,V)':<26} {'impl':<14} {'fwd ms':>9}"
            f" {'fwd+bwd ms':>11} {'resid MiB':>10} {'temp MiB':>9}"
            f" {'vs ref':>8} {'vs autodiff':>11} {'vs 640K@mm':>11}")
  print(header)
  print("-" * len(header))
  for r in rows:
    t = r["t"]
    ref = by.get(("reference", t))
    auto = by.get((AUTODIFF, t))
    ideal_ms = FLOP_PER_TOKEN_HEAD * B * t * HV / flops * 1e3
    r["speedup_vs_reference"] = ref and ref["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    r["speedup_vs_autodiff"] = auto and auto["fwd_bwd_ms"] / r["fwd_bwd_ms"]
    r["fwd_bwd_over_640k_flop_time"] = r["fwd_bwd_ms"] / ideal_ms
    shape = f"({B},{t},{HK},{HV},{DK},{DV})"
    print(f"{shape:<26} {r['impl']:<14} {r['fwd_ms']:>9.2f} {r['fwd_bwd_ms']:>11.2f}"
          f" {_mib(r['residual_bytes']):>10} {_mib(r['temp_bytes']):>9}"
          f" {_ratio(ref and ref['fwd_bwd_ms'], r['fwd_bwd_ms']):>8}"
          f" {_ratio(auto and auto['fwd_bwd_ms'], r['fwd_bwd_ms']):>11}"
          f" {r['fwd_bwd_over_640k_flop_time']:>10.1f}x")
  print(f"f32 matmul throughput (best round): {flops / 1e9:.1f} GFLOP/s"
        f" (640 KFLOP/token/head -> {FLOP_PER_TOKEN_HEAD * HV / flops * 1e9:.1f}"
        " ns/token at B=1, Hv=4)")
  scaling = {}
  t_lo, t_hi = min(seq_lens), max(seq_lens)
  for name in impls:
    lo, hi = by.get((name, t_lo)), by.get((name, t_hi))
    if lo and hi and t_hi > t_lo:
      scaling[name] = hi["fwd_bwd_ms"] / lo["fwd_bwd_ms"]
      print(f"{name}: fwd+bwd T={t_hi} / T={t_lo} = {scaling[name]:.2f}"
            f" (linear: {t_hi / t_lo:.2f})")
  inputs = {r["t"]: _mib(r["input_bytes"]) for r in rows}
  print("vs ref / vs autodiff: fwd+bwd speed-up (>1 = faster); resid: all arrays"
        " the VJP keeps for the backward, inputs included (inputs: "
        + ", ".join(f"T={t} {m} MiB" for t, m in inputs.items())
        + "); temp: compiled fwd+bwd scratch; vs 640K@mm: fwd+bwd time over"
        " 640 KFLOP/token/head at the measured matmul throughput.")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, matmul_flops=flops,
                     rows=rows, reps=args.reps,
                     scaling=dict(t_hi=t_hi, t_lo=t_lo, fwd_bwd_ratio=scaling)),
                f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
