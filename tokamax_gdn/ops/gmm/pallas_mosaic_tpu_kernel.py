"""Pallas Mosaic TPU kernel for gmm: out[rows_g] = lhs[rows_g] @ rhs[g].

Grid (n tiles, steps, k tiles). A *step* is one (row tile, group) pair: row
tiles are tm rows of lhs/out, and a tile that straddles group boundaries is
visited once per group it holds rows of, consecutively, so its output block
stays in VMEM across those visits and each visit stores only its group's rows
(a row mask). Empty groups get no step. Row tiles past sum(group_sizes) get
one "zero" step that writes zeros without touching the MXU. The step count is
data-dependent but bounded by tiles_m + G - 1, the static grid size; the
unused trailing steps are "idle": they keep the previous block indices (so no
DMA is issued) and do nothing.

Accumulation is in a float32 VMEM scratch over the k steps. Each operand is
converted to a common compute dtype inside the kernel (`base.compute_dtype`:
int8 / fp8 beside bf16 become bf16, f32 beside bf16 becomes bf16; f32 with f32
runs at HIGHEST precision), so mixed-dtype operands are DMA'd
in their own dtype and each block only has to respect its own dtype's native
(sublane, lane) tiling: 8/16/32 sublanes for 32/16/8-bit (see `block_size`).

M, N: partial last blocks (cdiv grids). Garbage rows/columns read past the
array edge only reach output rows/columns that are never written back. K: the
contraction must be exact, so the last k block masks its columns past K.
"""

import dataclasses

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops.gmm import base

LANES = 128

# Step modes, in SMEM.
COMPUTE, ZERO, IDLE = 0, 1, 2


def sublane_tiling(dtype) -> int:
  """Native second-minor tiling of a dtype in VMEM: 8 (32-bit), 16 (16-bit), 32 (8-bit)."""
  return 32 // max(1, min(4, jnp.dtype(dtype).itemsize))


def block_size(dim: int, tile: int, *, sublane_dtypes=(), lane: bool = False) -> int:
  """A legal block size <= `tile` along an axis of length `dim`.

  The full axis is always legal. Otherwise the block must be a multiple of
  128 where the axis is some operand's lane (minor) axis, and of each
  operand's *own* sublane tiling where it is that operand's second-minor axis
  (the lcm of those, i.e. the largest, since all are powers of two). No
  common floor is imposed, so a bf16 operand beside an int8 one is not forced
  onto the int8 tiling unless both share the axis.
  """
  if dim <= tile:
    return dim
  multiple = LANES if lane else 1
  for dt in sublane_dtypes:
    multiple = max(multiple, sublane_tiling(dt))
  size = max(multiple, tile // multiple * multiple)
  return dim if size >= dim else size


@dataclasses.dataclass(frozen=True)
class Tiles:
  tm: int
  tk: int
  tn: int


def gmm_tiles(m: int, k: int, n: int, lhs_dtype, rhs_dtype, out_dtype, *,
              tm: int, tk: int, tn: int, transpose_rhs: bool) -> Tiles:
  """Legal block sizes for gmm from requested ones.

  Axis roles: M is the sublane axis of lhs [tm, tk] and out [tm, tn]; K is the
  lane axis of lhs and the sublane (or, transposed, lane) axis of rhs; N is
  the lane axis of out and the lane (or, transposed, sublane) axis of rhs.
  """
  return Tiles(
      tm=block_size(m, tm, sublane_dtypes=(lhs_dtype, out_dtype)),
      tk=block_size(k, tk, lane=True, sublane_dtypes=() if transpose_rhs else (rhs_dtype,)),
      tn=block_size(n, tn, lane=True, sublane_dtypes=(rhs_dtype,) if transpose_rhs else ()),
  )


def _group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(sizes)
  return sizes, ends - sizes, ends


def _freeze(values: jax.Array, keep: jax.Array) -> jax.Array:
  """values[i] where keep[i], else the last kept value before i (values[0]'s if none)."""
  idx = jnp.where(keep, jnp.arange(values.shape[0]), -1)
  idx = jnp.maximum(lax.cummax(idx, axis=0), 0)
  return values[idx]


def gmm_schedule(group_sizes: jax.Array, *, m: int, tm: int) -> dict[str, jax.Array]:
  """Per-step (group, row tile, mode) for gmm; all int32 of length tiles_m + G - 1.

  Returns a dict with `offsets` [G + 1] and, per step, `group`, `tile` (the
  output row tile), `mode` (COMPUTE / ZERO / IDLE), and `in_tile` / `in_group`
  (the input block indices, frozen outside COMPUTE steps so that no DMA is
  issued for them).
  """
  g = group_sizes.shape[0]
  tiles_m = pl.cdiv(m, tm)
  num_steps = tiles_m + g - 1
  sizes, starts, ends = _group_bounds(group_sizes)
  total = ends[-1]
  first_tile = starts // tm
  count = jnp.where(sizes > 0, (ends - 1) // tm - first_tile + 1, 0)
  count_end = jnp.cumsum(count)
  real_steps = count_end[-1]
  step = jnp.arange(num_steps, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(count_end, step, side="right"), g - 1).astype(jnp.int32)
  compute_tile = first_tile[group] + step - (count_end - count)[group]
  zero_first = pl.cdiv(total, tm)
  zero_tile = zero_first + step - real_steps
  is_compute = step < real_steps
  is_zero = (~is_compute) & (zero_tile < tiles_m)
  mode = jnp.where(is_compute, COMPUTE, jnp.where(is_zero, ZERO, IDLE)).astype(jnp.int32)
  tile = jnp.where(is_compute, compute_tile, jnp.where(is_zero, zero_tile, tiles_m - 1))
  return dict(
      offsets=jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]),
      group=group,
      tile=tile.astype(jnp.int32),
      mode=mode,
      in_tile=_freeze(tile, is_compute).astype(jnp.int32),
      in_group=_freeze(group, is_compute).astype(jnp.int32),
  )


class Grid:
  """A grid with its size-1 axes dropped (the `keep` axis always stays).

  Kernels and index maps are written against the full named grid; `Grid`
  re-inserts 0 for dropped axes. Besides saving nothing at run time, this
  sidesteps a crash of libtpu's static LLO profiler ("No DMA issue node found
  for sync flag") seen on grids with size-1 axes next to the data-dependent
  step axis.
  """

  def __init__(self, axes: dict[str, int], keep: str):
    self.names = tuple(axes)
    self.kept = tuple(a for a, size in axes.items() if size > 1 or a == keep)
    self.shape = tuple(axes[a] for a in self.kept)

  def program_id(self, name: str):
    if name in self.kept:
      return pl.program_id(self.kept.index(name))
    return jnp.int32(0)

  def num_programs(self, name: str):
    if name in self.kept:
      return pl.num_programs(self.kept.index(name))
    return 1

  def index_map(self, fn):
    """fn(*full_grid_indices, *scalar_refs) -> block indices."""
    def wrapped(*args):
      ids = dict(zip(self.kept, args[:len(self.kept)]))
      full = [ids.get(a, jnp.int32(0)) for a in self.names]
      return fn(*full, *args[len(self.kept):])
    return wrapped

  def semantics(self, kinds: dict[str, str]) -> tuple[str, ...]:
    return tuple(kinds[a] for a in self.kept)


def mask_tail(x: jax.Array, axis: int, valid: int) -> jax.Array:
  """Zeros entries at index >= `valid` along `axis` (the K remainder)."""
  iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where(iota < valid, x, jnp.zeros_like(x))


def _dot_precision(compute_dtype):
  # f32 operands: full f32 accuracy (the numerical contract), not one bf16 pass.
  return lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None


def gmm(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    tiles: Tiles,
    out_dtype,
    transpose_rhs: bool,
    interpret: bool,
    vmem_limit_bytes: int | None = None,
) -> jax.Array:
  """out [M, N]; `tiles` must come from `gmm_tiles`."""
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
  tiles_m, tiles_k, tiles_n = pl.cdiv(m, tm), pl.cdiv(k, tk), pl.cdiv(n, tn)
  k_rem = k - (tiles_k - 1) * tk
  ct = base.compute_dtype(lhs.dtype, rhs.dtype)
  num_steps = tiles_m + group_sizes.shape[0] - 1
  sched = gmm_schedule(group_sizes, m=m, tm=tm)
  dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
  rhs_k_axis = 1 if transpose_rhs else 0

  grid = Grid(dict(n=tiles_n, i=num_steps, k=tiles_k), keep="i")

  def kernel(offsets, group, tile, mode, in_tile, in_group, lhs_ref, rhs_ref, out_ref,
             acc_ref):
    del in_tile, in_group
    i, kk = grid.program_id("i"), grid.program_id("k")
    step_mode = mode[i]
    last_k = kk == tiles_k - 1

    @pl.when((step_mode == COMPUTE) & (kk == 0))
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    def accumulate(masked: bool):
      x = lhs_ref[...].astype(ct)
      w = rhs_ref[...].astype(ct)
      if masked:
        x = mask_tail(x, 1, k_rem)
        w = mask_tail(w, rhs_k_axis, k_rem)
      acc_ref[...] += lax.dot_general(
          x, w, dims, preferred_element_type=jnp.float32, precision=_dot_precision(ct))

    if k_rem == tk:
      pl.when(step_mode == COMPUTE)(lambda: accumulate(False))
    else:
      pl.when((step_mode == COMPUTE) & ~last_k)(lambda: accumulate(False))
      pl.when((step_mode == COMPUTE) & last_k)(lambda: accumulate(True))

    @pl.when((step_mode == COMPUTE) & last_k)
    def _():
      g = group[i]
      t = tile[i]
      rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
      in_group = (rows >= offsets[g]) & (rows < offsets[g + 1])
      first_visit = (i == 0) | (tile[jnp.maximum(i - 1, 0)] != t)
      # On a tile's first visit the block holds stale VMEM: rows of other
      # groups (and past the last group) start at zero.
      prev = jnp.where(first_visit, 0.0, out_ref[...].astype(jnp.float32))
      out_ref[...] = jnp.where(in_group, acc_ref[...], prev).astype(out_ref.dtype)

    @pl.when((step_mode == ZERO) & last_k)
    def _():
      out_ref[...] = jnp.zeros_like(out_ref)

  def frozen_k(i, kk, mode):
    return jnp.where(mode[i] == COMPUTE, kk, tiles_k - 1)

  def lhs_map(nn, i, kk, offsets, group, tile, mode, in_tile, in_group):
    del nn, offsets, group, tile, in_group
    return in_tile[i], frozen_k(i, kk, mode)

  def rhs_map(nn, i, kk, offsets, group, tile, mode, in_tile, in_group):
    del offsets, group, tile, in_tile
    kb = frozen_k(i, kk, mode)
    return (in_group[i], nn, kb) if transpose_rhs else (in_group[i], kb, nn)

  def out_map(nn, i, kk, offsets, group, tile, mode, in_tile, in_group):
    del kk, offsets, group, mode, in_tile, in_group
    return tile[i], nn

  rhs_block = (None, tn, tk) if transpose_rhs else (None, tk, tn)
  out_itemsize = jnp.dtype(out_dtype).itemsize
  cost = pl.CostEstimate(
      flops=2 * m * k * n,
      transcendentals=0,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n
                      + k * n * rhs.dtype.itemsize * num_steps + m * n * out_itemsize),
  )
  call = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=6,
          grid=grid.shape,
          in_specs=[pl.BlockSpec((tm, tk), grid.index_map(lhs_map)),
                    pl.BlockSpec(rhs_block, grid.index_map(rhs_map))],
          out_specs=pl.BlockSpec((tm, tn), grid.index_map(out_map)),
          scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
      ),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=grid.semantics(dict(n="parallel", i="arbitrary", k="arbitrary")),
          vmem_limit_bytes=vmem_limit_bytes,
      ),
      interpret=interpret,
      cost_estimate=cost,
      name="tokamax_gdn_gmm",
  )
  return call(sched["offsets"], sched["group"], sched["tile"], sched["mode"],
              sched["in_tile"], sched["in_group"], lhs, rhs)


def vmem_bytes(tiles: Tiles, lhs_dtype, rhs_dtype, out_dtype, *, buffers: int = 2) -> int:
  """VMEM for gmm: double-buffered in/out blocks, the f32 accumulator, and the
  compute-dtype copies of the operand blocks made before the matmul."""
  tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
  size = lambda dt: jnp.dtype(dt).itemsize
  ct = base.compute_dtype(lhs_dtype, rhs_dtype)
  blocks = buffers * (tm * tk * size(lhs_dtype) + tk * tn * size(rhs_dtype)
                      + tm * tn * size(out_dtype))
  converted = (tm * tk + tk * tn) * size(ct)
  return blocks + tm * tn * 4 * 2 + converted


