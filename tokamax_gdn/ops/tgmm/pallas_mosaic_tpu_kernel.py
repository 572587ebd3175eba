"""Pallas Mosaic TPU kernel for tgmm: out[g] = lhs[rows_g]^T @ rhs[rows_g].

Grid (k tiles, n tiles, steps). A *step* is one (row tile, group) pair, as in
gmm (`tokamax_gdn.ops.gmm.pallas_mosaic_tpu_kernel`), but here the row tiles
are the contraction: the steps of one group are consecutive, accumulate
lhs_tile^T @ rhs_tile (rows outside the group masked to zero in *both*
operands, so rows of other groups, rows past sum(group_sizes) and the garbage
past M in a partial last tile never reach the sum, even as inf/NaN) into a
float32 [tk, tn] scratch, and the group's output block is stored on its last
step. An empty group gets one step that stores zeros without touching the
MXU or issuing a DMA. Unused trailing steps (the static grid is
tiles_m + G - 1) repeat the last group's block indices and do nothing.

Each operand keeps its own dtype in HBM and VMEM; its block respects its own
native sublane tiling (M is the sublane axis of both inputs, K the sublane
axis of the output) and both are converted to a common compute dtype in VMEM.
K and N use partial last blocks: garbage there only reaches output entries
that are never written back.
"""

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops.gmm import base as gmm_base
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu_kernel as gmm_kernel

Tiles = gmm_kernel.Tiles
COMPUTE, ZERO, IDLE = gmm_kernel.COMPUTE, gmm_kernel.ZERO, gmm_kernel.IDLE


def tgmm_tiles(m: int, k: int, n: int, lhs_dtype, rhs_dtype, out_dtype, *,
               tm: int, tk: int, tn: int) -> Tiles:
  """Legal block sizes: M sublane of lhs [tm, tk] and rhs [tm, tn]; K lane of
  lhs and sublane of out [tk, tn]; N lane of rhs and out."""
  bs = gmm_kernel.block_size
  return Tiles(
      tm=bs(m, tm, sublane_dtypes=(lhs_dtype, rhs_dtype)),
      tk=bs(k, tk, lane=True, sublane_dtypes=(out_dtype,)),
      tn=bs(n, tn, lane=True),
  )


def tgmm_schedule(group_sizes: jax.Array, *, m: int, tm: int) -> dict[str, jax.Array]:
  """Per-step (group, row tile, mode) for tgmm; int32 of length tiles_m + G - 1."""
  g = group_sizes.shape[0]
  tiles_m = pl.cdiv(m, tm)
  num_steps = tiles_m + g - 1
  sizes, starts, ends = gmm_kernel._group_bounds(group_sizes)  # pylint: disable=protected-access
  first_tile = jnp.minimum(starts // tm, tiles_m - 1)
  count = jnp.where(sizes > 0, (ends - 1) // tm - starts // tm + 1, 1)
  count_end = jnp.cumsum(count)
  step = jnp.arange(num_steps, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(count_end, step, side="right"), g - 1).astype(jnp.int32)
  tile = jnp.minimum(first_tile[group] + step - (count_end - count)[group], tiles_m - 1)
  is_real = step < count_end[-1]
  is_compute = is_real & (sizes[group] > 0)
  mode = jnp.where(is_compute, COMPUTE, jnp.where(is_real, ZERO, IDLE)).astype(jnp.int32)
  return dict(
      offsets=jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]),
      group=group,
      mode=mode,
      tile=tile.astype(jnp.int32),
      in_tile=gmm_kernel._freeze(tile, is_compute).astype(jnp.int32),  # pylint: disable=protected-access
  )


def tgmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: Tiles,
    out_dtype,
    interpret: bool,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
  """out [G, K, N]; `tiles` must come from `tgmm_tiles`."""
  m, k = lhs.shape
  n = rhs.shape[1]
  num_groups = group_sizes.shape[0]
  tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
  tiles_m, tiles_k, tiles_n = pl.cdiv(m, tm), pl.cdiv(k, tk), pl.cdiv(n, tn)
  num_steps = tiles_m + num_groups - 1
  ct = gmm_base.compute_dtype(lhs.dtype, rhs.dtype)
  sched = tgmm_schedule(group_sizes, m=m, tm=tm)
  precision = lax.Precision.HIGHEST if ct == jnp.float32 else None

  grid = gmm_kernel.Grid(dict(k=tiles_k, n=tiles_n, i=num_steps), keep="i")

  def kernel(offsets, group, mode, tile, in_tile, lhs_ref, rhs_ref, out_ref, acc_ref):
    del in_tile
    i = grid.program_id("i")
    g = group[i]
    first = (i == 0) | (group[jnp.maximum(i - 1, 0)] != g)
    last = (i == num_steps - 1) | (group[jnp.minimum(i + 1, num_steps - 1)] != g)

    @pl.when(first)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    row0 = tile[i] * tm
    lo, hi = offsets[g], offsets[g + 1]
    compute = mode[i] == COMPUTE
    # Tiles wholly inside the group (most of them) skip the masking; a tile
    # also holding other rows (or the garbage past M) masks both operands.
    interior = (row0 >= lo) & (row0 + tm <= hi)

    def accumulate(masked: bool):
      x = lhs_ref[...].astype(ct)
      y = rhs_ref[...].astype(ct)
      if masked:
        x_rows = row0 + lax.broadcasted_iota(jnp.int32, (tm, tk), 0)
        y_rows = row0 + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
        x = jnp.where((x_rows >= lo) & (x_rows < hi), x, jnp.zeros_like(x))
        y = jnp.where((y_rows >= lo) & (y_rows < hi), y, jnp.zeros_like(y))
      acc_ref[...] += lax.dot_general(
          x, y, (((0,), (0,)), ((), ())),
          preferred_element_type=jnp.float32, precision=precision)

    pl.when(compute & interior)(lambda: accumulate(False))
    pl.when(compute & ~interior)(lambda: accumulate(True))

    @pl.when(last)
    def _():
      out_ref[...] = acc_ref[...].astype(out_ref.dtype)

  def lhs_map(kk, nn, i, offsets, group, mode, tile, in_tile):
    del nn, offsets, group, mode, tile
    return in_tile[i], kk

  def rhs_map(kk, nn, i, offsets, group, mode, tile, in_tile):
    del kk, offsets, group, mode, tile
    return in_tile[i], nn

  def out_map(kk, nn, i, offsets, group, mode, tile, in_tile):
    del offsets, mode, tile, in_tile
    return group[i], kk, nn

  cost = pl.CostEstimate(
      flops=2 * m * k * n,
      transcendentals=0,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n
                      + rhs.size * rhs.dtype.itemsize * tiles_k
                      + num_groups * k * n * jnp.dtype(out_dtype).itemsize),
  )
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=5,
          grid=grid.shape,
          in_specs=[pl.BlockSpec((tm, tk), grid.index_map(lhs_map)),
                    pl.BlockSpec((tm, tn), grid.index_map(rhs_map))],
          out_specs=pl.BlockSpec((None, tk, tn), grid.index_map(out_map)),
          scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)],
      ),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=grid.semantics(dict(k="parallel", n="parallel", i="arbitrary")),
          vmem_limit_bytes=vmem_limit_bytes,
      ),
      interpret=interpret,
      cost_estimate=cost,
      name="tokamax_gdn_tgmm",
  )
  return call(sched["offsets"], sched["group"], sched["mode"], sched["tile"],
              sched["in_tile"], lhs, rhs)


def vmem_bytes(tiles: Tiles, lhs_dtype, rhs_dtype, out_dtype, *, buffers: int = 2) -> int:
  """Double-buffered blocks, the f32 accumulator and compute-dtype operand copies."""
  tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
  size = lambda dt: jnp.dtype(dt).itemsize
  ct = gmm_base.compute_dtype(lhs_dtype, rhs_dtype)
  blocks = buffers * (tm * tk * size(lhs_dtype) + tm * tn * size(rhs_dtype)
                      + tk * tn * size(out_dtype))
  converted = (tm * tk + tm * tn) * size(ct)
  return blocks + tk * tn * 4 * 2 + converted
