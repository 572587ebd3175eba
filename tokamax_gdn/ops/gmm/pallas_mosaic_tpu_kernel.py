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
import functools
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
      # The schedule leads the scalar-prefetch refs (others may follow it).
      refs = args[len(self.kept):]
      return fn(*full, Schedule(*refs[:len(Schedule._fields)]))
    return wrapped

  def semantics(self, kinds: dict[str, str]) -> tuple[str, ...]:
    return tuple(kinds[a] for a in self.kept)


def _grouped_call(body, *, grid: Grid, sched: Schedule, operands, in_specs, out_spec,
                  out_shape, semantics, flops, bytes_accessed, name,
                  interpret, vmem_limit_bytes, scratch_shapes=(), prefetch=()):
  """pallas_call of `body(schedule, *refs)` with the schedule (and the arrays
  `prefetch`, whose refs lead `refs`) in SMEM."""
  n_sched = len(Schedule._fields)

  def kernel(*refs):
    body(Schedule(*refs[:n_sched]), *refs[n_sched:])

  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=n_sched + len(prefetch),
          grid=grid.shape,
          in_specs=in_specs,
          out_specs=out_spec,
          scratch_shapes=list(scratch_shapes),
      ),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=grid.semantics(semantics), vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
      cost_estimate=pl.CostEstimate(flops=flops, transcendentals=0,
                                    bytes_accessed=bytes_accessed),
      name=name,
  )(*sched, *prefetch, *operands)


def mask_tail(x: jax.Array, axis: int, valid: int) -> jax.Array:
  """Zeros entries at index >= `valid` along `axis` (the K remainder)."""
  iota = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where(iota < valid, x, jnp.zeros_like(x))


def _dot_precision(compute_dtype):
  # f32 operands: full f32 accuracy (the numerical contract), not one bf16 pass.
  return lax.Precision.HIGHEST if jnp.dtype(compute_dtype) == jnp.float32 else None


# gmm and tgmm are jitted: calls with equal shapes and static arguments (a
# model's MoE layers, their VJPs' products) share one trace of the kernel, and
# its calls in one program are lowered once there.
@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "transpose_rhs", "interpret",
                                             "vmem_limit_bytes"))
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

  def store(s: Schedule, i, out_ref, result):
    """Writes `result` (tm, tn) float32 into the group's rows of the tile."""
    g = s.group[i]
    t = s.tile[i]
    rows = t * tm + lax.broadcasted_iota(jnp.int32, (tm, tn), 0)
    in_group = (rows >= s.offsets[g]) & (rows < s.offsets[g + 1])
    first_visit = (i == 0) | (s.tile[jnp.maximum(i - 1, 0)] != t)
    # On a tile's first visit the block holds stale VMEM: rows of other
    # groups (and past the last group) start at zero.
    prev = jnp.where(first_visit, 0.0, out_ref[...].astype(jnp.float32))
    out_ref[...] = jnp.where(in_group, result, prev).astype(out_ref.dtype)

  sched = schedule(group_sizes, m=m, tm=tm, visit_empty_groups=False)
  if whole_groups(tiles, k, n, rhs.dtype):
    return _gmm_whole_groups(lhs, rhs, group_sizes, sched, store, grid=grid, tm=tm, n=n,
                              out_dtype=out_dtype, dims=dims, ct=ct, interpret=interpret,
                              vmem_limit_bytes=vmem_limit_bytes)

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
      store(s, i, out_ref, acc_ref[...])

    @pl.when((step_mode == ZERO) & last_k)
    def _():
      out_ref[...] = jnp.zeros_like(out_ref)

  def k_block(i, kk, s):
    return jnp.where(s.mode[i] == COMPUTE, kk, tiles_k - 1)

  def rhs_map(nn, i, kk, s):
    kb = k_block(i, kk, s)
    return (s.in_group[i], nn, kb) if transpose_rhs else (s.in_group[i], kb, nn)

  return _grouped_call(
      body, grid=grid, sched=sched, operands=(lhs, rhs),
      in_specs=[
          pl.BlockSpec((tm, tk), grid.index_map(
              lambda nn, i, kk, s: (s.in_tile[i], k_block(i, kk, s)))),
          pl.BlockSpec((None, tn, tk) if transpose_rhs else (None, tk, tn),
                       grid.index_map(rhs_map))],
      out_spec=pl.BlockSpec((tm, tn), grid.index_map(lambda nn, i, kk, s: (s.tile[i], nn))),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
      semantics=dict(n="parallel", i="arbitrary", k="arbitrary"),
      flops=2 * m * k * n,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n + k * n * rhs.dtype.itemsize
                      * num_steps + m * n * jnp.dtype(out_dtype).itemsize),
      name="tokamax_gdn_gmm", interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)


# VMEM slots of a group's whole [K, N] block in flight: gmm's weights fetched
# ahead (`_gmm_whole_groups`), tgmm's outputs written back (`tgmm`).
RING_SLOTS = 3


# The ring pays where a group's block takes longer to copy than the row
# tiles before it take to multiply (at MoE shapes it is MiBs). Below this the
# grid pipeline's copy one step ahead hides it, and the block stays a
# pipelined operand: on the v5e chip the ring's hand-copied operand, small
# enough for XLA to place in VMEM, crashed libtpu's compiler (abort) at the
# int8 x bf16 conformance spec (M64 K32 N48, 3 groups: 3 KiB blocks), which
# the grid form had passed there.
RING_MIN_BYTES = 1 << 20


def whole_groups(tiles: Tiles, k: int, n: int, dtype) -> bool:
  """Whether a group's whole [K, N] (gmm's weights, tgmm's output; `dtype`
  its elements') is one block of at least `RING_MIN_BYTES`, which then
  moves by group through RING_SLOTS slots rather than by grid step through
  the pipeline's two buffers."""
  return (tiles.tk >= k and tiles.tn >= n
          and k * n * jnp.dtype(dtype).itemsize >= RING_MIN_BYTES)


def _weight_order(group_sizes: jax.Array, sched: Schedule):
  """(order [G]: the non-empty groups in row order, then zeros; count [1]:
  how many; rank [steps]: each step's group's place in `order`, frozen outside
  COMPUTE steps; fresh [steps]: 1 on each group's first step)."""
  g = group_sizes.shape[0]
  nonempty = jnp.maximum(group_sizes.astype(jnp.int32), 0) > 0
  rank_of = jnp.cumsum(nonempty.astype(jnp.int32)) - 1
  order = jnp.zeros((g,), jnp.int32).at[jnp.where(nonempty, rank_of, g)].set(
      jnp.arange(g, dtype=jnp.int32), mode="drop")
  count = jnp.sum(nonempty.astype(jnp.int32), keepdims=True)
  compute = sched.mode == COMPUTE
  prev = jnp.concatenate([jnp.full((1,), -1, jnp.int32), sched.in_group[:-1]])
  fresh = compute & (sched.in_group != prev)
  rank = jnp.maximum(rank_of[sched.in_group], 0)
  return order, count, rank.astype(jnp.int32), fresh.astype(jnp.int32)


def _gmm_whole_groups(lhs, rhs, group_sizes, sched: Schedule, store, *, grid: Grid, tm: int,
                       n: int, out_dtype, dims, ct, interpret: bool, vmem_limit_bytes):
  """gmm with each group's whole weights in one block, fetched by hand.

  The grid pipeline fetches a block one step ahead, and a group's weights
  (MiBs) take longer to arrive than the one or two row tiles before them
  take to multiply: every group change stalled. Here the weights of the
  non-empty groups are copied into `RING_SLOTS` VMEM slots in row order,
  each started when the group `RING_SLOTS` - 1 places before it begins (its
  slot's previous group is then finished), so a copy has whole groups'
  compute to hide behind.
  """
  m, k = lhs.shape
  order, count, rank, fresh = _weight_order(group_sizes, sched)

  def copy(rhs_hbm, wbuf, sems, order_ref, r):
    slot = r % RING_SLOTS
    return pltpu.make_async_copy(rhs_hbm.at[order_ref[r]], wbuf.at[slot], sems.at[slot])

  def body(s: Schedule, order_ref, count_ref, rank_ref, fresh_ref, lhs_ref, rhs_hbm, out_ref,
           wbuf, sems):
    i = grid.program_id("i")
    r = rank_ref[i]

    @pl.when(fresh_ref[i] == 1)
    def _():
      @pl.when(r == 0)
      def _():
        for ahead in range(RING_SLOTS - 1):
          @pl.when(ahead < count_ref[0])
          def _():
            copy(rhs_hbm, wbuf, sems, order_ref, ahead).start()

      copy(rhs_hbm, wbuf, sems, order_ref, r).wait()

      @pl.when(r + RING_SLOTS - 1 < count_ref[0])
      def _():
        copy(rhs_hbm, wbuf, sems, order_ref, r + RING_SLOTS - 1).start()

    @pl.when(s.mode[i] == COMPUTE)
    def _():
      x = lhs_ref[...].astype(ct)
      w = wbuf[r % RING_SLOTS].astype(ct)
      store(s, i, out_ref, lax.dot_general(
          x, w, dims, preferred_element_type=jnp.float32, precision=_dot_precision(ct)))

    @pl.when(s.mode[i] == ZERO)
    def _():
      out_ref[...] = jnp.zeros_like(out_ref)

  return _grouped_call(
      body, grid=grid, sched=sched, prefetch=(order, count, rank, fresh),
      operands=(lhs, rhs),
      in_specs=[pl.BlockSpec((tm, k), grid.index_map(lambda nn, i, kk, s: (s.in_tile[i], 0))),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_spec=pl.BlockSpec((tm, n), grid.index_map(lambda nn, i, kk, s: (s.tile[i], 0))),
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      scratch_shapes=[pltpu.VMEM((RING_SLOTS,) + rhs.shape[1:], rhs.dtype),
                      pltpu.SemaphoreType.DMA((RING_SLOTS,))],
      semantics=dict(n="arbitrary", i="arbitrary", k="arbitrary"),
      flops=2 * m * k * n,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize + rhs.size * rhs.dtype.itemsize
                      + m * n * jnp.dtype(out_dtype).itemsize),
      name="tokamax_gdn_gmm", interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)


@functools.partial(jax.jit, static_argnames=("tiles", "out_dtype", "interpret",
                                             "vmem_limit_bytes"))
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

  # With whole groups the output blocks (MiBs) leave by hand through a ring
  # of RING_SLOTS slots: the pipeline wrote each back while the next group's
  # one or two steps ran and waited for it before reusing its buffer, so
  # every group change stalled. Group g's block is written back from slot
  # g % RING_SLOTS (tgmm visits every group once, in order), and the copy
  # is waited for when group g + RING_SLOTS needs the slot, or at the end.
  ring = whole_groups(tiles, k, n, out_dtype) and num_groups > 0

  def copy(obuf, out_hbm, sems, group):
    slot = group % RING_SLOTS
    return pltpu.make_async_copy(obuf.at[slot], out_hbm.at[group], sems.at[slot])

  def body(s: Schedule, lhs_ref, rhs_ref, out_ref, acc_ref, *ring_refs):
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

    if not ring:
      @pl.when(last)
      def _():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)
      return

    obuf, sems = ring_refs

    @pl.when(last)
    def _():
      @pl.when(g >= RING_SLOTS)
      def _():
        copy(obuf, out_ref, sems, g - RING_SLOTS).wait()

      obuf[g % RING_SLOTS] = acc_ref[...].astype(obuf.dtype)
      copy(obuf, out_ref, sems, g).start()

    # The last group ends on the last step (trailing idle steps keep it).
    @pl.when(i == num_steps - 1)
    def _():
      for group in range(max(num_groups - RING_SLOTS, 0), num_groups):
        copy(obuf, out_ref, sems, group).wait()

  if ring:
    out_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [pltpu.VMEM((tk, tn), jnp.float32),
               pltpu.VMEM((RING_SLOTS, k, n), out_dtype), pltpu.SemaphoreType.DMA((RING_SLOTS,))]
  else:
    out_spec = pl.BlockSpec((None, tk, tn),
                            grid.index_map(lambda kk, nn, i, s: (s.group[i], kk, nn)))
    scratch = [pltpu.VMEM((tk, tn), jnp.float32)]
  return _grouped_call(
      body, grid=grid, sched=schedule(group_sizes, m=m, tm=tm, visit_empty_groups=True),
      operands=(lhs, rhs),
      in_specs=[pl.BlockSpec((tm, tk), grid.index_map(lambda kk, nn, i, s: (s.in_tile[i], kk))),
                pl.BlockSpec((tm, tn), grid.index_map(lambda kk, nn, i, s: (s.in_tile[i], nn)))],
      out_spec=out_spec,
      out_shape=jax.ShapeDtypeStruct((num_groups, k, n), out_dtype),
      scratch_shapes=scratch,
      semantics=dict(k="parallel", n="parallel", i="arbitrary"),
      flops=2 * m * k * n,
      bytes_accessed=(lhs.size * lhs.dtype.itemsize * tiles_n + rhs.size * rhs.dtype.itemsize
                      * tiles_k + num_groups * k * n * jnp.dtype(out_dtype).itemsize),
      name="tokamax_gdn_tgmm", interpret=interpret, vmem_limit_bytes=vmem_limit_bytes)


def vmem_bytes(tiles: Tiles, lhs_dtype, rhs_dtype, out_dtype, *, transposed: bool,
               buffers: int = 2, ring: bool = False) -> int:
  """VMEM of gmm (`transposed`=False) or tgmm (True): double-buffered blocks, the
  f32 accumulator (counted twice: the result of each dot before it is added),
  and the compute-dtype copies of the input blocks made before the matmul.
  `ring` (`whole_groups`): gmm's weights or tgmm's output blocks sit in
  RING_SLOTS slots instead."""
  tm, tk, tn = tiles.tm, tiles.tk, tiles.tn
  size = lambda dt: jnp.dtype(dt).itemsize
  ct = base.compute_dtype(lhs_dtype, rhs_dtype)
  # gmm: lhs [tm, tk], rhs [tk, tn], out/acc [tm, tn]; tgmm: lhs [tm, tk], rhs [tm, tn], out/acc [tk, tn].
  rhs_block, out_block = (tm * tn, tk * tn) if transposed else (tk * tn, tm * tn)
  blocks = buffers * (tm * tk * size(lhs_dtype) + rhs_block * size(rhs_dtype)
                      + out_block * size(out_dtype))
  if ring:
    ring_block = out_block * size(out_dtype) if transposed else rhs_block * size(rhs_dtype)
    blocks += (RING_SLOTS - buffers) * ring_block
  return blocks + out_block * 4 * 2 + (tm * tk + rhs_block) * size(ct)
