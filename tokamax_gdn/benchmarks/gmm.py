"""Benchmark of gmm on a TPU generation, by AOT compile and static cycle estimates.

`run(target, m, k, n, g, dtype)` (`tokamax-gdn bench --op gmm`). No TPU is
needed: every kernel is compiled for `target` through libtpu and
the compiler's static cycle estimate is read back (`tokamax_gdn.aot`). One
table, same shape and dtype for every row:
- ours: `pallas_mosaic_tpu` gmm with its heuristics config (and `--tiles`),
  and the two backward products (dX: gmm with transposed rhs; dW: tgmm);
- tokamax v1: `tokamax.ragged_dot(implementation="mosaic_tpu")` (its own
  heuristics config);
- dense: a plain Pallas matmul of the same M, K, N (no groups), best of a
  few tilings: the ceiling a grouped matmul is measured against.
Columns: grid steps, estimated cycles, FLOP per cycle, % of the dense
FLOP/cycle, and modelled HBM bytes per FLOP (lhs re-reads per n tile, rhs
re-reads per step unless its block index stays put). The estimate is a proxy
(see `tokamax_gdn.aot`); where the compiler reports 0 cycles (kernels with inner
pipelines) the row says so and the structure columns are the comparison.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn import aot

DENSE_TILES = ((512, 1024, 1024), (1024, 512, 1024), (1024, 1024, 1024), (512, 2048, 1024))


def _cycles(report: aot.CompileReport, prefix: str | None, fallback: bool = True) -> int | None:
  """The kernel's estimate: the entry named `prefix`, else (`fallback`) the largest one."""
  cycles = report.kernel_cycles
  if not cycles:
    return None
  if prefix:
    named = [v for k, v in cycles.items() if k.startswith(prefix)]
    if named:
      return max(named)
    if not fallback:
      return None
  return max(cycles.values())


def _compile(target: str, fn, *specs) -> aot.CompileReport:
  aot.clear_cycle_dumps()
  return aot.compile_for(target, fn, *specs)


def _traffic(m, k, n, g, tm, tk, tn, itemsize) -> tuple[int, int]:
  """(grid steps, modelled HBM bytes) of a megablox-style gmm grid (n, steps, k)."""
  tiles_m, tiles_k, tiles_n = -(-m // tm), -(-k // tk), -(-n // tn)
  steps = tiles_m + g - 1
  lhs = m * k * itemsize * tiles_n
  rhs = (g if tiles_k == 1 else steps) * k * n * itemsize
  out = m * n * itemsize
  return tiles_n * steps * tiles_k, lhs + rhs + out


def tgmm_cases(mesh, m: int, k: int, n: int, g: int, dtype: str) -> list[aot.Case]:
  """The pallas_mosaic_tpu tgmm on [M, K] x [M, N] (an `aot.compile_in_child` builder)."""
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  tg = registry.get("tgmm", "pallas_mosaic_tpu")
  return [("tgmm", tg, [aot.spec(mesh, (m, k), dtype), aot.spec(mesh, (m, n), dtype),
                        aot.spec(mesh, (g,), jnp.int32)])]


def _tgmm_cycles_isolated(target, m, k, n, g, dtype) -> tuple[int | None, str]:
  """tgmm's estimate from a child process: libtpu's static LLO profiler aborts
  the whole process ("No DMA issue node found for sync flag") on some tgmm
  grids although the kernel itself compiles; don't let that kill the bench."""
  (result,) = aot.compile_in_child(target, "tokamax_gdn.benchmarks.gmm:tgmm_cases",
                                   dict(m=m, k=k, n=n, g=g, dtype=jnp.dtype(dtype).name))
  if result.report is None:
    return None, f"compiles; no estimate ({result.error[:120]})"
  value = _cycles(result.report, "tokamax_gdn_tgmm")
  return value, "" if value else "compiler reports 0 / no estimate"


def run(target: str, m: int, k: int, n: int, g: int, dtype, tiles=None) -> list[dict[str, Any]]:
  """Compiles ours, tokamax v1 and the dense matmul for `target`; one dict per row.

  Turns the cycle dump on in this process (`aot.enable_cycle_estimates`): call
  it before anything else compiles for a TPU here.
  """
  aot.enable_cycle_estimates()
  import tokamax  # pylint: disable=g-import-not-at-top
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.gmm import pallas_mosaic_tpu  # pylint: disable=g-import-not-at-top

  flops = 2 * m * k * n
  itemsize = jnp.dtype(dtype).itemsize
  specs = (((m, k), dtype), ((g, k, n), dtype), ((g,), jnp.int32))
  rows = []
  ours = registry.get("gmm", "pallas_mosaic_tpu")
  mesh = aot.target_mesh(target)
  with aot.on_target(mesh):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in specs]
    heuristic = ours.bind(*args).heuristics_config
  configs = [("ours (heuristics)", heuristic)]
  if tiles:
    configs.append(("ours (--tiles)", pallas_mosaic_tpu.Config(tm=tiles[0], tk=tiles[1],
                                                              tn=tiles[2])))
  for label, cfg in configs:
    op = ours.replace(config=cfg)
    fn = lambda x, w, gs, op=op: op(x, w, gs)
    rep = _compile(target, fn, *specs)
    steps, nbytes = _traffic(m, k, n, g, cfg.tm, min(cfg.tk, k), min(cfg.tn, n), itemsize)
    rows.append(dict(kernel=label, config=f"tm={cfg.tm} tk={min(cfg.tk, k)} tn={min(cfg.tn, n)}",
                     grid_steps=steps, cycles=_cycles(rep, "tokamax_gdn_gmm"),
                     hbm_bytes=nbytes))

  # The backward's two products, ours with heuristics: dX = gmm(dY, W, transposed)
  # and dW = tgmm(X, dY).
  with aot.on_target(mesh):
    dx_cfg = ours.bind(jax.ShapeDtypeStruct((m, n), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
                       jax.ShapeDtypeStruct((g,), jnp.int32), transpose_rhs=True
                       ).heuristics_config
    tg = registry.get("tgmm", "pallas_mosaic_tpu")
    dw_cfg = tg.bind(jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((m, n), dtype),
                     jax.ShapeDtypeStruct((g,), jnp.int32)).heuristics_config
  rep = _compile(target, lambda dy, w, gs: ours(dy, w, gs, transpose_rhs=True),
                 ((m, n), dtype), ((g, k, n), dtype), ((g,), jnp.int32))
  steps, nbytes = _traffic(m, n, k, g, dx_cfg.tm, min(dx_cfg.tk, n), min(dx_cfg.tn, k), itemsize)
  rows.append(dict(kernel="ours dX = gmm(dY, W^T)",
                   config=f"tm={dx_cfg.tm} tk={min(dx_cfg.tk, n)} tn={min(dx_cfg.tn, k)}",
                   grid_steps=steps, cycles=_cycles(rep, "tokamax_gdn_gmm"), hbm_bytes=nbytes))
  dw_cycles, dw_note = _tgmm_cycles_isolated(target, m, k, n, g, dtype)
  tk_, tn_ = min(dw_cfg.tk, k), min(dw_cfg.tn, n)
  steps = (-(-k // tk_)) * (-(-n // tn_)) * (-(-m // dw_cfg.tm) + g - 1)
  nbytes = (m * k * (-(-n // tn_)) + m * n * (-(-k // tk_)) + g * k * n) * itemsize
  rows.append(dict(kernel="ours dW = tgmm(X, dY)",
                   config=f"tm={dw_cfg.tm} tk={tk_} tn={tn_}",
                   grid_steps=steps, cycles=dw_cycles, hbm_bytes=nbytes, note=dw_note))

  def tokamax_v1(x, w, gs):
    return tokamax.ragged_dot(x, w, gs, implementation="mosaic_tpu")

  from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tokamax_tpu  # pylint: disable=g-import-not-at-top
  with aot.on_target(mesh):
    tc = tokamax_tpu.PallasMosaicTpuRaggedDot().bind(
        *args[:2], group_sizes=args[2]).heuristics_config
  rep = _compile(target, tokamax_v1, *specs)
  steps, nbytes = _traffic(m, k, n, g, tc.tile_m, min(tc.tile_k, k), min(tc.tile_n, n), itemsize)
  cyc = _cycles(rep, "pallas_tpu_ragged_dot_gmm", fallback=False)
  rows.append(dict(kernel="tokamax v1 ragged_dot mosaic_tpu",
                   config=f"tm={tc.tile_m} tk={tc.tile_k} tn={tc.tile_n} (its heuristics)",
                   grid_steps=steps, cycles=cyc, hbm_bytes=nbytes,
                   note="" if cyc else "kernel absent from the profile dump / 0: no estimate"))

  best = None
  for tm, tk, tn in dict.fromkeys((min(a, m), min(b, k), min(c, n)) for a, b, c in DENSE_TILES):
    if m % tm or k % tk or n % tn:
      continue
    fn = functools.partial(aot.dense_matmul, tm=tm, tk=tk, tn=tn)
    try:
      rep = _compile(target, fn, ((m, k), dtype), ((k, n), dtype))
    except Exception:  # pylint: disable=broad-except
      continue  # a tiling that does not fit this chip's VMEM
    cyc = _cycles(rep, "dense_matmul")
    if cyc and (best is None or cyc < best["cycles"]):
      nbytes = m * k * itemsize * (n // tn) + k * n * itemsize * (m // tm) + m * n * itemsize
      best = dict(kernel="dense matmul (best tile)", config=f"tm={tm} tk={tk} tn={tn}",
                  grid_steps=(m // tm) * (n // tn) * (k // tk), cycles=cyc, hbm_bytes=nbytes)
  if best:
    rows.append(best)
  dense_fpc = flops / best["cycles"] if best else None
  for r in rows:
    r["flops"] = flops
    r["flop_per_cycle"] = flops / r["cycles"] if r["cycles"] else None
    r["pct_dense"] = (100 * r["flop_per_cycle"] / dense_fpc
                      if r["flop_per_cycle"] and dense_fpc else None)
    r["hbm_bytes_per_flop"] = r["hbm_bytes"] / flops
    r.setdefault("note", "" if r["cycles"] else "compiler reports 0 / no estimate")
  return rows
