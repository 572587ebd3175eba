"""Pallas Mosaic TPU kernels for the causal depthwise conv1d (fused SiLU).

Shapes inside a grid step (b, j, i): a time tile of bt tokens and a channel
tile of bd lanes. Tap w reads s = W-1-w tokens back, so a tile needs the
H = 8 >= W-1 inputs before it; those come as a small precomputed "halo"
([B, nT, 8, D], built in XLA from x and the initial state) rather than from
the previous grid step, so every grid axis is parallel (megacore splits any).

Shifted reads are `pltpu.roll`s of the whole f32 window along sublanes
followed by aligned slices (the XLU rotates; unaligned ref slices cost ~45 %
more VPU/load work in the static estimate).

Forward, per row r of the tile (xb = [halo_prev; x_tile] in a float32 scratch):
  pre[r] = bias + sum_w weight[w] * xb[8 + r - s] * (s <= reach[r]);  y = silu(pre)

Backward, with dpre[u] = dy[u] * silu'(pre[u]) for u over the tile and the
8 rows after it (the forward is recomputed there from a second halo):
  dx[r]      = sum_w weight[w] * (s <= reach[r+s]) * dpre[r+s]
  dweight[w] = sum_r (s <= reach[r]) * dpre[r] * xb[8 + r - s]    (per-tile partial)
  dbias      = sum_r dpre[r]                                      (per-tile partial)
The partials ([B, nT, W, D]) are summed in XLA; the initial-state gradient
(only the first W-1 tokens see it) is left to the wrapper.

`reach` (see base.py) is passed lane-dense ([B, T, 128] int32) so that every
ref is (8, 128)-tiled; it is absent without segment_ids.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

HALO = 8        # rows of history / lookahead per tile; W - 1 <= HALO
REACH_LANES = 128


def _silu_and_grad(pre):
  sig = jax.nn.sigmoid(pre)
  return pre * sig, sig * (1.0 + pre * (1.0 - sig))


def _fwd_kernel(*refs, width, activation, has_bias, has_reach):
  it = iter(refs)
  x_ref, prev_ref, w_ref = next(it), next(it), next(it)
  b_ref = next(it) if has_bias else None
  reach_ref = next(it) if has_reach else None
  y_ref, xb = next(it), next(it)
  bt = x_ref.shape[0]
  xb[:HALO, :] = prev_ref[...].astype(jnp.float32)
  xb[HALO:, :] = x_ref[...].astype(jnp.float32)
  w = w_ref[...].astype(jnp.float32)                        # [W, bd]
  acc = jnp.zeros(y_ref.shape, jnp.float32)
  if has_bias:
    acc = acc + b_ref[...].astype(jnp.float32)
  reach = reach_ref[:, :1] if has_reach else None             # [bt, 1]
  full = xb[...]
  for tap in range(width):
    s = width - 1 - tap
    shifted = pltpu.roll(full, s, 0)[HALO:] if s else full[HALO:]
    term = shifted * w[tap:tap + 1, :]
    if has_reach and s:
      term = jnp.where(s <= reach, term, 0.0)
    acc = acc + term
  y = _silu_and_grad(acc)[0] if activation == "silu" else acc
  y_ref[...] = y.astype(y_ref.dtype)


def _bwd_kernel(*refs, width, activation, has_bias, has_reach):
  it = iter(refs)
  x_ref, prev_ref, next_ref, dy_ref, dy_next_ref, w_ref = (next(it) for _ in range(6))
  b_ref = next(it) if has_bias else None
  if has_reach:
    reach_ref, reach_next_ref = next(it), next(it)
  dx_ref, dw_ref, db_ref, xb, db = (next(it) for _ in range(5))
  rb = next(it) if has_reach else None
  bt = x_ref.shape[0]
  n_ext = bt + HALO                       # the tile's rows and the 8 after it
  xb[:HALO, :] = prev_ref[...].astype(jnp.float32)
  xb[HALO:HALO + bt, :] = x_ref[...].astype(jnp.float32)
  xb[HALO + bt:, :] = next_ref[...].astype(jnp.float32)
  db[:bt, :] = dy_ref[...].astype(jnp.float32)
  db[bt:, :] = dy_next_ref[...].astype(jnp.float32)
  w = w_ref[...].astype(jnp.float32)
  reach = None
  if has_reach:
    rb[:bt, :] = reach_ref[...]
    rb[bt:, :] = reach_next_ref[...]
    reach = rb[...][:, :1]                # [n_ext, 1]

  # Input s tokens back for every extended row (aligned slices of rolled values).
  full = xb[...]
  shifted = [pltpu.roll(full, s, 0)[HALO:HALO + n_ext] if s else full[HALO:HALO + n_ext]
             for s in range(width)]
  acc = jnp.zeros((n_ext, xb.shape[1]), jnp.float32)
  if has_bias:
    acc = acc + b_ref[...].astype(jnp.float32)
  for tap in range(width):
    s = width - 1 - tap
    term = shifted[s] * w[tap:tap + 1, :]
    if has_reach and s:
      term = jnp.where(s <= reach, term, 0.0)
    acc = acc + term
  dy = db[...]
  g = dy * _silu_and_grad(acc)[1] if activation == "silu" else dy      # d pre, [n_ext, bd]

  # dweight / dbias partials over this tile's own rows.
  g_main = g[:bt]
  for tap in range(width):
    s = width - 1 - tap
    term = g_main * shifted[s][:bt]
    if has_reach and s:
      term = jnp.where(s <= reach[:bt], term, 0.0)
    dw_ref[tap:tap + 1, :] = jnp.sum(term, axis=0, keepdims=True)
  db_ref[...] = jnp.sum(g_main, axis=0, keepdims=True)

  # dx: row r gathers the taps that read it, from rows r + s (roll by -s).
  dx = jnp.zeros(dx_ref.shape, jnp.float32)
  for tap in range(width):
    s = width - 1 - tap
    gs = jnp.where(s <= reach, g, 0.0) if has_reach and s else g
    if s:
      gs = pltpu.roll(gs, n_ext - s, 0)
    dx = dx + gs[:bt] * w[tap:tap + 1, :]
  dx_ref[...] = dx.astype(dx_ref.dtype)


def _tiles(a, bt):
  """[B, Tp, D] -> [B, nT, bt, D]."""
  b, tp, d = a.shape
  return a.reshape(b, tp // bt, bt, d)


def halo_prev(a, bt, first):
  """[B, nT, 8, D]: the 8 rows before each tile; `first` [B, 8, D] before tile 0."""
  t = _tiles(a, bt)[:, :-1, bt - HALO:]
  return jnp.concatenate([first[:, None], t], axis=1)


def halo_next(a, bt):
  """[B, nT, 8, D]: the 8 rows after each tile (zeros after the last)."""
  t = _tiles(a, bt)[:, 1:, :HALO]
  zeros = jnp.zeros((a.shape[0], 1, HALO, a.shape[2]), a.dtype)
  return jnp.concatenate([t, zeros], axis=1)


def _specs(bt, bd):
  row = pl.BlockSpec((None, bt, bd), lambda b, j, i: (b, i, j))
  halo = pl.BlockSpec((None, None, HALO, bd), lambda b, j, i: (b, i, 0, j))
  reach = pl.BlockSpec((None, bt, REACH_LANES), lambda b, j, i: (b, i, 0))
  reach_halo = pl.BlockSpec((None, None, HALO, REACH_LANES), lambda b, j, i: (b, i, 0, 0))
  return row, halo, reach, reach_halo


def conv_fwd(x, x_prev, w_t, bias, reach, *, bt, bd, activation, interpret,
             vmem_limit_bytes=None, in_hbm=False):
  """x [B, Tp, Dp] (Tp % bt == 0, Dp % bd == 0), x_prev [B, nT, 8, Dp], w_t [W, Dp],
  bias [1, Dp] | None, reach [B, Tp, 128] int32 | None -> y [B, Tp, Dp].

  `in_hbm`: x and y stay in HBM (else XLA may place them in VMEM)."""
  b, tp, dp = x.shape
  width = w_t.shape[0]
  row, halo, reach_spec, _ = _specs(bt, bd)
  in_specs = [row, halo, pl.BlockSpec((width, bd), lambda b, j, i: (0, j))]
  out_shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
  if in_hbm:
    x = pltpu.with_memory_space_constraint(x, pltpu.HBM)
    out_shape = pltpu.HBM(x.shape, x.dtype)
  args = [x, x_prev, w_t]
  if bias is not None:
    in_specs.append(pl.BlockSpec((1, bd), lambda b, j, i: (0, j)))
    args.append(bias)
  if reach is not None:
    in_specs.append(reach_spec)
    args.append(reach)
  kernel = functools.partial(_fwd_kernel, width=width, activation=activation,
                             has_bias=bias is not None, has_reach=reach is not None)
  return pl.pallas_call(
      kernel,
      grid=(b, dp // bd, tp // bt),
      in_specs=in_specs,
      out_specs=row,
      out_shape=out_shape,
      scratch_shapes=[pltpu.VMEM((HALO + bt, bd), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel"),
          vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
  )(*args)


def conv_bwd(x, x_prev, x_next, dy, dy_next, w_t, bias, reach, reach_next, *, bt, bd,
             activation, interpret, vmem_limit_bytes=None):
  """-> (dx [B, Tp, Dp] x.dtype, dw partials [B, nT, W, Dp] f32, db partials [B, nT, 1, Dp] f32)."""
  b, tp, dp = x.shape
  width = w_t.shape[0]
  nt = tp // bt
  row, halo, reach_spec, reach_halo = _specs(bt, bd)
  in_specs = [row, halo, halo, row, halo, pl.BlockSpec((width, bd), lambda b, j, i: (0, j))]
  args = [x, x_prev, x_next, dy, dy_next, w_t]
  if bias is not None:
    in_specs.append(pl.BlockSpec((1, bd), lambda b, j, i: (0, j)))
    args.append(bias)
  if reach is not None:
    in_specs += [reach_spec, reach_halo]
    args += [reach, reach_next]
  kernel = functools.partial(_bwd_kernel, width=width, activation=activation,
                             has_bias=bias is not None, has_reach=reach is not None)
  return pl.pallas_call(
      kernel,
      grid=(b, dp // bd, nt),
      in_specs=in_specs,
      out_specs=[
          row,
          pl.BlockSpec((None, None, width, bd), lambda b, j, i: (b, i, 0, j)),
          pl.BlockSpec((None, None, 1, bd), lambda b, j, i: (b, i, 0, j)),
      ],
      out_shape=[
          jax.ShapeDtypeStruct(x.shape, x.dtype),
          jax.ShapeDtypeStruct((b, nt, width, dp), jnp.float32),
          jax.ShapeDtypeStruct((b, nt, 1, dp), jnp.float32),
      ],
      scratch_shapes=[pltpu.VMEM((HALO + bt + HALO, bd), jnp.float32),
                      pltpu.VMEM((bt + HALO, bd), jnp.float32)]
      + ([pltpu.VMEM((bt + HALO, REACH_LANES), jnp.int32)] if reach is not None else []),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel"),
          vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
  )(*args)
