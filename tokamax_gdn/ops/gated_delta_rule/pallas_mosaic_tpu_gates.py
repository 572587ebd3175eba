"""Per-token gate stages of the Pallas GDN kernels, all heads at once.

Rows hold heads in sublanes and tokens in lanes. `chunk_cumsum` is the
compensated, segment-restarted in-chunk cumsum; `chunk_gate` turns a chunk's
log-decays into G, decay_out, decay_chunk and the causal masks; `gamma_decay_in`
broadcasts one head's gates to Γ and decay_in tiles; `rowsum_row` and
`lane_rowsums` take row sums on the MXU. Algebra: `docs/gdn_math.md` ("Notation", "The
compensated cumsum"); TPU layout: `docs/gdn_pallas_tpu.md`.
"""

import dataclasses
import functools
import math
import operator

import jax
from jax import lax
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
from jaxtyping import Array  # pylint: disable=g-importing-member

from tokamax_gdn.ops import numerics
from tokamax_gdn.ops import segments

F32, BF16 = jnp.float32, jnp.bfloat16
_NEG_INF = -jnp.inf


def chunk_cumsum(x, starts, axis: int = 1):
  """Segment-local inclusive prefix sums along `axis`, compensated.

  x: (H, C) f32 (axis 1, tokens in lanes) or (C, H) (axis 0, tokens in
  sublanes); starts: 1 where a segment starts, (1, C) or (C, 1) as x, or
  None. Returns (hi, lo) with hi + lo the sum to ~f32 precision of each term
  (TwoSum in a Hillis–Steele scan). (The backward's reverse sums are one
  MXU product against the causal mask, `bwd_kernel.bwd_kernel`.)
  """
  c = x.shape[axis]
  pos = lax.broadcasted_iota(jnp.int32, x.shape, axis)
  hi, lo = x, jnp.zeros_like(x)
  flag = None if starts is None else jnp.broadcast_to(starts, x.shape)
  shift = 1
  while shift < c:
    ok = pos >= shift
    take = lambda y: pltpu.roll(y, shift, axis)
    if flag is not None:
      ok = ok & (flag == 0.0)
      other_flag = take(flag)
    new_hi, err = numerics.two_sum(take(hi), hi)
    lo = jnp.where(ok, lo + take(lo) + err, lo)
    hi = jnp.where(ok, new_hi, hi)
    if flag is not None:
      flag = jnp.where(pos >= shift, jnp.maximum(flag, other_flag), flag)
    shift *= 2
  return hi, lo


@dataclasses.dataclass(frozen=True)
class ChunkGate:
  """`chunk_gate` of docs/gdn_math.md for every head of a grid step."""

  g_hi: jax.Array          # (H, C) gcum = g_hi + g_lo
  g_lo: jax.Array
  decay_chunk: jax.Array   # (H, 1)
  decay_out: jax.Array     # (H, C)
  run: jax.Array | None    # (1, C) in-chunk segment index (None: no segments)
  run_col: jax.Array | None
  causal: jax.Array        # (C, C) j <= i, same segment
  strict: jax.Array        # (C, C) j < i, same segment


def chunk_gate(g_cols, starts, scan_axis: int = 0):
  """Gates of one chunk from its (C, H) f32 log-decays as the block arrives
  (tokens in sublanes) and starts (C, 1) or None; rows (H, C) out.

  `scan_axis` 0: the cumsum runs down the sublanes, then hi and lo are
  transposed to rows. 1: the block is transposed first and the cumsum runs
  along the lanes, whose Hillis–Steele levels each rotate the lanes (XLU);
  in the forward kernels that is on the critical path (so they run down the
  sublanes); the backward is faster along the lanes."""
  c = g_cols.shape[0]
  if scan_axis == 0:
    run = None if starts is None else chunk_cumsum(starts, None, axis=0)[0].T
    g_hi, g_lo = (x.T for x in chunk_cumsum(g_cols, starts, axis=0))
  else:
    run = None if starts is None else chunk_cumsum(starts.T, None)[0]
    g_hi, g_lo = chunk_cumsum(g_cols.T, None if starts is None else starts.T)
  last_hi, last_lo = g_hi[:, c - 1:c], g_lo[:, c - 1:c]
  decay_chunk = jnp.exp(last_hi + last_lo)
  decay_out = jnp.exp((last_hi - g_hi) + (last_lo - g_lo))
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  causal, strict = row >= col, row > col
  run_col = None
  if run is not None:
    decay_chunk = jnp.where(run[:, c - 1:c] == 0.0, decay_chunk, 0.0)
    decay_out = jnp.where(run == run[:, c - 1:c], decay_out, 0.0)
    run_col = run.T
    same = jnp.broadcast_to(run_col, (c, c)) == run
    causal, strict = causal & same, strict & same
  return ChunkGate(g_hi, g_lo, decay_chunk, decay_out, run, run_col, causal, strict)


def gamma_decay_in(gate_rows, masks, dim_k: int, dim_v: int | None = None):
  """Γ (C×C) and decay_in broadcast over the key dim (C×dim_k) of one head;
  with `dim_v`, a third value: decay_in broadcast over the value dim (C×dim_v).

  gate_rows: the head's (1, C) rows g_hi, g_lo and, with segments, run;
  g_lo None: G = g_hi alone (uncompensated: G_i − G_j off by up to a few
  float32 ulps of |G|).
  Columns come from transposing the row broadcast (XLU); decay_in is the
  exp of G's columns, a tile of exp on the EUP. (The exp of the (1, C) row,
  transposed on its own, took a transpose more per head, dearer in the
  backward and, since the paired inverse put the forward's critical path on
  the XLU, in the forward too.)
  """
  g_hi, g_lo, run = gate_rows
  causal, _ = masks
  c = g_hi.shape[-1]
  dim_in = max(dim_k, dim_v or 0)
  width = max(c, dim_in)
  hc = jnp.broadcast_to(g_hi, (width, c)).T             # (C, width): G_i in row i
  if g_lo is None:
    diff = hc[:, :c] - g_hi
    log_in = hc[:, :dim_in]
  else:
    lc = jnp.broadcast_to(g_lo, (width, c)).T
    diff = (hc[:, :c] - g_hi) + (lc[:, :c] - g_lo)
    log_in = hc[:, :dim_in] + lc[:, :dim_in]
  gamma = jnp.exp(jnp.where(causal, diff, _NEG_INF))
  decay_in = jnp.exp(log_in)
  if run is not None:
    first = jnp.broadcast_to(run, (dim_in, c)).T == 0.0
    decay_in = jnp.where(first, decay_in, 0.0)
  if dim_v is None:
    return gamma, decay_in
  return gamma, decay_in[:, :dim_k], decay_in[:, :dim_v]


def rowsum_row(x, pieces=2, v5e_forms=False, *, weights=None):
  """Row sums of x (C×n f32) as a (1, C) row, by the MXU against ones (NT).

  A lane reduction on the vector units costs ~9 cycles per vreg; the MXU sums
  exactly per bf16 piece: two pieces (hi + lo) keep ~2⁻¹⁶ of each term, three
  all of it (for sums that must cancel against a float32 sum of the same terms).
  `weights` (1, n) f32: the row sums of x ⊙ weights (x's rows scaled per
  column), against the weights' three bf16 pieces instead of ones (each
  product exact) -- the scaled tile itself is never formed.
  """
  c, n = x.shape
  if weights is None:
    lhs = jnp.ones((8, n), BF16)
  else:
    parts = [wide for _, wide in numerics.split(weights, 3, v5e_forms)]
    # Rows 3..7 repeat the pieces (unused): zero rows made libtpu's v5e
    # estimator abort (a masked matmul of a bf16 operand).
    lhs = jnp.concatenate(parts * 2 + parts[:2], 0).astype(BF16)
  y = numerics.mm(lhs, numerics.stacked_bf16(x, pieces, v5e_forms)[0], tb=True)   # (8, pieces C)
  if weights is not None:
    y = jnp.sum(y[0:3], axis=0, keepdims=True)
  return sum(y[0:1, p * c:(p + 1) * c] for p in range(pieces))


def lane_rowsums(x, lane, pieces=1, v5e_forms=False, *, weighted=None):
  """Row sums of x (C×n f32) in lane `lane` of a (C, 128) tile, zeros
  elsewhere: x (its `pieces` bf16 pieces) against a one-hot column on the
  MXU. Heads' sums add up in one tile, one lane each, and one transpose
  makes them rows (`bwd_kernel.bwd_kernel`). The row form, ones against x transposed
  (`rowsum_row`), pushes x as transposed weights, ~7 cycles per pushed vreg
  against 3–4 (a visible share of gdn_bwd at one piece per head).

  `weighted` (y, w_cols): adds the row sums of y ⊙ w, w a (1, m) row scaling
  y's (C×m, bf16) columns, given as `w_cols` (m, 128) f32 whose lane `lane`
  holds w as a column, exact in bf16: each product y_ij w_j is exact.
  """
  n = x.shape[1]
  one_hot = (lax.broadcasted_iota(jnp.int32, (n, 128), 1) == lane).astype(BF16)
  sums = [numerics.mm(piece, one_hot) for piece in numerics.split_bf16(x, pieces, v5e_forms)]
  if weighted is not None:
    y, w_cols = weighted
    w_lane = lax.broadcasted_iota(jnp.int32, w_cols.shape, 1) == lane
    sums.append(numerics.mm(y, numerics.lhs_masked(w_lane, w_cols, v5e_forms).astype(BF16)))
  return functools.reduce(operator.add, sums)
