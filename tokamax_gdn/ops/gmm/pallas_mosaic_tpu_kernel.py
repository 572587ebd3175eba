"""Pallas Mosaic TPU kernels for gmm and tgmm (one schedule for both).

  gmm:  out[rows_g] = lhs[rows_g] @ rhs[g]          lhs [M, K], rhs [G, K, N], out [M, N]
  tgmm: out[g] = lhs[rows_g]^T @ rhs[rows_g]        lhs [M, K], rhs [M, N], out [G, K, N]

Both walk the rows in tiles of tm. A *step* is one (row tile, group) pair: a
tile that straddles group boundaries is visited once per group it holds rows
of, consecutively. `schedule` lays the steps out (data-dependent, bounded by
tiles_m + G - 1, the static grid size); unused trailing steps are "idle": they
keep the previous block indices (so no DMA is issued) and do nothing. The two
differ only in what else gets a step (`visit_empty_groups`):
- gmm (rows are the output rows): empty groups get no step; each row tile
  past sum(group_sizes) gets one "zero" step that writes zeros without
  touching the MXU. A tile's output block stays in VMEM across its
  consecutive visits and each visit stores only its group's rows (a row mask).
- tgmm (rows are the contraction): each empty group gets one "zero" step
  that stores its zero output block; the steps of one group are consecutive
  and accumulate lhs_tile^T @ rhs_tile (rows outside the group masked to zero
  in *both* operands, so rows of other groups, rows past sum(group_sizes) and
  the garbage past M in a partial last tile never reach the sum, even as
  inf/NaN) into a float32 [tk, tn] scratch, stored on the group's last step.

Accumulation is in float32 VMEM scratch. Each operand is DMA'd in its own
dtype and converted in VMEM to a common compute dtype (`base.compute_dtype`:
int8 / fp8 beside bf16 become bf16, f32 beside bf16 becomes bf16; f32 with f32
runs at HIGHEST precision), so each block only has to respect its own dtype's
native (sublane, lane) tiling: 8/16/32 sublanes for 32/16/8-bit (`block_size`).

Partial last blocks (cdiv grids) along M and N (gmm) or K and N (tgmm):
garbage read past an array edge only reaches output entries that are never
written back. gmm's K is a contraction and must be exact: its last k block
masks the columns past K.
"""

import dataclasses
from typing import NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops.gmm import base
from tokamax_gdn.ops.tiling import LANES, sublane_tiling  # pylint: disable=g-importing-member

# Step modes, in SMEM.
COMPUTE, ZERO, IDLE = 0, 1, 2


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


def tgmm_tiles(m: int, k: int, n: int, lhs_dtype, rhs_dtype, out_dtype, *,
               tm: int, tk: int, tn: int) -> Tiles:
  """Legal block sizes: M sublane of lhs [tm, tk] and rhs [tm, tn]; K lane of
  lhs and sublane of out [tk, tn]; N lane of rhs and out."""
  return Tiles(
      tm=block_size(m, tm, sublane_dtypes=(lhs_dtype, rhs_dtype)),
      tk=block_size(k, tk, lane=True, sublane_dtypes=(out_dtype,)),
      tn=block_size(n, tn, lane=True),
  )


def _group_bounds(group_sizes: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  sizes = jnp.maximum(group_sizes.astype(jnp.int32), 0)
  ends = jnp.cumsum(sizes)  # int32 whatever the dtype of group_sizes
  return sizes, ends - sizes, ends


def _freeze(values: jax.Array, keep: jax.Array) -> jax.Array:
  """values[i] where keep[i], else the last kept value before i (values[0]'s if none)."""
  idx = jnp.where(keep, jnp.arange(values.shape[0]), -1)
  idx = jnp.maximum(lax.cummax(idx, axis=0), 0)
  return values[idx]


class Schedule(NamedTuple):
  """The steps of a grouped kernel (int32 arrays; refs in SMEM inside the kernel).

  `offsets` [G + 1] are the group row offsets; per step: `group`, `tile` (the
  row tile), `mode` (COMPUTE / ZERO / IDLE), and `in_tile` / `in_group`, the
  input block indices, frozen outside COMPUTE steps so that no DMA is issued
  for them.
  """

  offsets: jax.Array
  group: jax.Array
  tile: jax.Array
  mode: jax.Array
  in_tile: jax.Array
  in_group: jax.Array


def schedule(group_sizes: jax.Array, *, m: int, tm: int, visit_empty_groups: bool) -> Schedule:
  """The steps over row tiles of tm rows and groups; tiles_m + G - 1 of them.

  ZERO steps are, with `visit_empty_groups` (tgmm), one per empty group; without
  (gmm), one per row tile past sum(group_sizes).
  """
  g = group_sizes.shape[0]
  tiles_m = pl.cdiv(m, tm)
  num_steps = tiles_m + g - 1
  sizes, starts, ends = _group_bounds(group_sizes)
  first_tile = jnp.minimum(starts // tm, tiles_m - 1)
  count = jnp.where(sizes > 0, (ends - 1) // tm - starts // tm + 1,
                    1 if visit_empty_groups else 0)
  count_end = jnp.cumsum(count)
  real_steps = count_end[-1]
  step = jnp.arange(num_steps, dtype=jnp.int32)
  group = jnp.minimum(jnp.searchsorted(count_end, step, side="right"), g - 1).astype(jnp.int32)
  group_tile = jnp.minimum(first_tile[group] + step - (count_end - count)[group], tiles_m - 1)
  is_real = step < real_steps
  is_compute = is_real & (sizes[group] > 0)
  if visit_empty_groups:
    is_zero = is_real & ~is_compute
    tile = group_tile
  else:
    trailing_tile = pl.cdiv(ends[-1], tm) + step - real_steps
    is_zero = ~is_real & (trailing_tile < tiles_m)
    tile = jnp.where(is_real, group_tile, jnp.where(is_zero, trailing_tile, tiles_m - 1))
  mode = jnp.where(is_compute, COMPUTE, jnp.where(is_zero, ZERO, IDLE)).astype(jnp.int32)
  tile = tile.astype(jnp.int32)
  return Schedule(
      offsets=jnp.concatenate([jnp.zeros((1,), jnp.int32), ends]),
      group=group,
      tile=tile,
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

  def index_map(self, fn):
    """fn(*full_grid_indices, schedule) -> block indices."""
    def wrapped(*args):
      ids = dict(zip(self.kept, args[:len(self.kept)]))
      full = [ids.get(a, jnp.int32(0)) for a in self.names]
      return fn(*full, Schedule(*args[len(self.kept):]))
    return wrapped

  def semantics(self, kinds: dict[str, str]) -> tuple[str, ...]:
    return tuple(kinds[a] for a in self.kept)


def _grouped_call(body, *, grid: Grid, sched: Schedule, operands, in_specs, out_spec,
                  out_shape, acc_shape, semantics, flops, bytes_accessed, name,
                  interpret, vmem_limit_bytes):
  """pallas_call of `body(schedule, *refs)` with the schedule prefetched into SMEM,
  one float32 accumulator of `acc_shape` in VMEM."""
  def kernel(*refs):
    body(Schedule(*refs[:len(Schedule._fields)]), *refs[len(Schedule._fields):])

  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(Schedule._fields),
          grid=grid.shape,
          in_specs=in_specs,
          out_specs=out_spec,
          scratch_shapes=[pltpu.VMEM(acc_shape, jnp.float32)],
      ),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=grid.semantics(semantics), vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0,
                                    bytes_accessed=bytes_accessed),
      name=name,
  )(*sched, *operands)


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
  dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
  rhs_k_axis = 1 if transpose_rhs else 0
  grid = Grid(dict(n=tiles_n, i=num_steps, k=tiles_k), keep="i")

  def body(s: Schedule, lhs_ref, rhs_ref, out_ref, acc_ref):
    i, kk = grid.program_id("i"), grid.program_id("k")
    step_mode = s.mode[i]
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
      g = s.group[i]
      t = s.tile[i]
      rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
      in_group = (rows >= s.offsets[g]) & (rows < s.offsets[g + 1])
      first_visit = (i == 0) | (s.tile[jnp.maximum(i - 1, 0)] != t)
      # On a tile's first visit the block holds stale VMEM: rows of other
      # groups (and past the last group) start at zero.
      prev = jnp.where(first_visit, 0.0, out_ref[...].astype(jnp.float32))
      out_ref[...] = jnp.where(in_group, acc_ref[...], prev).astype(out_ref.dtype)

    @pl.when((step_mode == ZERO) & last_k)
    def _():
      out_ref[...] = jnp.zeros_like(out_ref)

  def k_block(i, kk, s):
    return jnp.where(s.mode[i] == COMPUTE, kk, tiles_k - 1)

  def rhs_map(nn, i, kk, s):
    kb = k_block(i, kk, s)
    return (s.in_group[i], nn, kb) if transpose_rhs else (s.in_group[i], kb, nn)

  return _grouped_call(
      body, grid=grid, sched=schedule(group_sizes, m=m, tm=tm, visit_empty_groups=False),
      operands=(lhs, rhs),
      in_specs=[
          pl.BlockSpec((tm, tk), grid.index_map(
              lambda nn, i, kk, s: (s.in_tile[i], k_block(i, kk, s)))),
          pl.BlockSpec((None, tn, tk) if transpose_rhs else (None, tk, tn),
                       grid.index_map(rhs_map))],
      out_spec=pl.BlockSpec((tm, tn), grid.index_map(lambda nn, i, kk, s: (s.tile[i], nn))),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype), acc_shape=(tm, tn),
      semantics=dict(n="parallel", i="arbitrary", k="arbitrary"),
      flops=2 * m * k * n,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n + k * n * rhs.dtype.itemsize
                      * num_steps + m * n * jnp.dtype(out_dtype).itemsize),
      name="tokamax_gdn_gmm", interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)


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
  ct = base.compute_dtype(lhs.dtype, rhs.dtype)
  grid = Grid(dict(k=tiles_k, n=tiles_n, i=num_steps), keep="i")

  def body(s: Schedule, lhs_ref, rhs_ref, out_ref, acc_ref):
    i = grid.program_id("i")
    g = s.group[i]
    first = (i == 0) | (s.group[jnp.maximum(i - 1, 0)] != g)
    last = (i == num_steps - 1) | (s.group[jnp.minimum(i + 1, num_steps - 1)] != g)

    @pl.when(first)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    row0 = s.tile[i] * tm
    lo, hi = s.offsets[g], s.offsets[g + 1]
    compute = s.mode[i] == COMPUTE
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
          preferred_element_type=jnp.float32, precision=_dot_precision(ct))

    pl.when(compute & interior)(lambda: accumulate(False))
    pl.when(compute & ~interior)(lambda: accumulate(True))

    @pl.when(last)
    def _():
      out_ref[...] = acc_ref[...].astype(out_ref.dtype)

  return _grouped_call(
      body, grid=grid, sched=schedule(group_sizes, m=m, tm=tm, visit_empty_groups=True),
      operands=(lhs, rhs),
      in_specs=[pl.BlockSpec((tm, tk), grid.index_map(lambda kk, nn, i, s: (s.in_tile[i], kk))),
                pl.BlockSpec((tm, tn), grid.index_map(lambda kk, nn, i, s: (s.in_tile[i], nn)))],
      out_spec=pl.BlockSpec((None, tk, tn),
                            grid.index_map(lambda kk, nn, i, s: (s.group[i], kk, nn))),
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype), acc_shape=(tk, tn),
      semantics=dict(k="parallel", n="parallel", i="arbitrary"),
      flops=2 * m * k * n,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n + rhs.size * rhs.dtype.itemsize
                      * tiles_k + num_groups * k * n * jnp.dtype(out_dtype).itemsize),
      name="tokamax_gdn_tgmm", interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)


def vmem_bytes(tiles: Tiles, lhs_dtype, rhs_dtype, out_dtype, *, transposed: bool,
               buffers: int = 2) -> int:
  """VMEM of gmm (`transposed`=False) or tgmm (True): double-buffered blocks, the
  f32 accumulator (counted twice: the result of each dot before it is added),
  and the compute-dtype copies of the input blocks made before the matmul."""
  tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
  size = lambda dt: jnp.dtype(dt).itemsize
  ct = base.compute_dtype(lhs_dtype, rhs_dtype)
  # gmm: lhs [tm, tk], rhs [tk, tn], out/acc [tm, tn]; tgmm: lhs [tm, tk], rhs [tm, tn], out/acc [tk, tn].
  rhs_block, out_block = (tm * tn, tk * tn) if transposed else (tk * tn, tm * tn)
  blocks = buffers * (tm * tk * size(lhs_dtype) + rhs_block * size(rhs_dtype)
                      + out_block * size(out_dtype))
  return blocks + out_block * 4 * 2 + (tm * tk + rhs_block) * size(ct)
