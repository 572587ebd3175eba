"""Pallas Mosaic TPU kernels of the chunked gated delta rule (forward + VJP).

The math, its notation and the backward equations are in `math.md` (same
names here); this module is its TPU form. What is specific to it:

Factored beta. T = (I + A)⁻¹ with A = D_β M, M = strict_lower(K Kᵀ ⊙ Γ),
D_β = diag(β). The kernels invert A' = M D_β instead and use the
push-through identity T D_β = D_β T', T' = (I + A')⁻¹:

  [W̃ | Ũ] = T' [K ⊙ decay_in | V]        (W = D_β W̃, U = D_β Ũ)
  V″ = Ũ − W̃ S = T' (V − (K ⊙ decay_in) S)   (V′ = D_β V″; the forward
                                             kernels take the second form)
  O  = scale [(Q ⊙ decay_in) S + (P̃ ⊙ β_j) V″],     P̃ = (Q Kᵀ) ⊙ Γ
  S′ = decay_chunk S + (Kᵀ ⊙ (decay_out β)_j) V″

so β only ever scales columns (j), a sublane broadcast, never rows: a
per-row scale of a C×C tile is a lane broadcast, which costs as much as a
128³ matmul on the vector units.

Layout and grid. q, k, v, o (and dO, dq, dk, dv) reach the kernels as
[B, T, H D] (a reshape of [B, T, H, D]), g and beta as [B, T, Hv]. A grid
step (b, chunk) loads every head of its chunk: the (C, H D) block is one
contiguous DMA, and a head is an aligned lane slice of it (`_token_block`,
`_load_heads`). (Splitting heads over the grid makes it a strided 3-D DMA,
which libtpu's static cycle estimator does not model: it reports 0. A
(C, H, D) block, tiled over (H, D), had to be relaid out head-major with an
`einshape`, and the outputs back: 9 % of gdn_fwd, 12 % of gdn_bwd.) The chunk axis is
sequential: S (and dS in the backward) stays in VMEM.

Heads stage-major. Each stage (gates, Γ, K Kᵀ, every level of the inverse,
W/U, the state products) runs for `interleave` heads before the next stage
starts: a dependent chain of 128² matmuls is latency-bound (~180 cycles
each), independent ones are throughput-bound (~16). Measured (v6e, T=256,
Hv=32, C=128, bf16): one head at a time 277 k cycles, stage-major 16 heads
41 k.

Gates in-kernel. The log-decay and beta blocks are transposed to rows
(heads in sublanes, tokens in lanes); the in-chunk cumsum is a
Hillis–Steele scan over lanes for all heads at once, restarted at segment
starts and compensated (TwoSum): G = hi + lo, and G_i − G_j is taken as
(hi_i − hi_j) + (lo_i − lo_j), so a chunk that sits at the −30 floor for half
its tokens keeps the small gates after it (the float32 contract at every
chunk size). Per-token columns reach C×C tiles by lane broadcasts on the
XLU, which these kernels otherwise leave idle.

Precision. bfloat16 inputs: one bf16 MXU pass per product (f32
accumulation), except the inverse (below). float32 inputs: three bf16
passes (hi·hi + hi·lo + lo·hi of a hi/lo split), ~2⁻¹⁶ relative per
product; both the same in Pallas interpret mode on CPU, so tests there see
the TPU's rounding. The inverse: T0 from the 2×2 diagonal blocks merged
blockwise up to C, all in bf16 passes, two heads per product
(`invert_unit_lower`); for bf16 inputs that is T (~3e-3 on correlated keys,
as close to (I + A')⁻¹ as rounding A' or T to bf16 puts it); float32 inputs
add two Newton steps T ← T + T (I − (I + A') T), their residuals with A'
split hi + lo (~1e-5).

v5e forms (`_Static.v5e_forms`, on when tracing for v5e). v5e has no bf16
VPU, and Mosaic moves bf16 values between layouts there through 16-bit
integer packing, which libtpu's static cycle estimator rejects (an LLO type
check aborts the compile; the chip compile itself succeeds). Four constructs
led there; for v5e the kernels avoid them, elsewhere they keep the bf16
forms (v6e, Qwen3-Next heads, T=512: gdn_fwd / gdn_fwd_states / gdn_bwd
72.4 / 60.7 / 94.0 k cycles in the bf16 forms, 81.7 / 68.3 / 95.0 k in the
v5e forms, the forward's guard branches, `_Static.guard_branched`, included):
- a concatenation of bf16 arrays: matmul operands are concatenated in f32
  and cast once (`_operand_cat`, `stacked_bf16`);
- a bf16 value that is both a matmul operand and widened back to f32 (its
  (8, 128) tiling is relaid out for the MXU): T and the base blocks of the
  inverse, and the hi / lo pieces of float32 operands, are rounded in f32
  arithmetic instead (`round_bf16`), so the bf16 value is an exact cast
  that is never widened;
- a select against +0.0 reaching a matmul's left operand (folded into a
  masked matmul): it selects -0.0 (`lhs_masked`; the inverse's blocks, the
  backward's dΓ-weighted QKᵀ, `sanitize`'s zeroed keys);
- a bf16 residual stored in the (8, 128) tiling of its HBM block while the
  same cast feeds a matmul: the store casts a value of its own (`_residual`).
`tests/aot_test.py` checks that v5e has per-kernel estimates.

Per-segment states ([B, N, Hv, K, V] with segment ids): the wrappers move
the tokens to the chunk-aligned layout (`segments.align_segments`) and give the
kernels one code per chunk in SMEM (scalar prefetch): take the segment's
state on entry, write the state out on leaving, and which slot the state
blocks' index maps fetch (math.md, "Per-segment states").

Prologue in-kernel (`Prologue`). The kernels read the raw q, k and gate:
q, k are L2-normalised per head tile (`_normed`; row sums as lane
reductions), as a head group reads them (in the forward kernels on tpu7x:
in the head-major scratch first, `_Static.qk_in_place`), the gate is activated and floored in the
(C, Hv) block before the gate rows (`_log_decay`), and beta's logits go
through the sigmoid there too (`_beta_block`, `use_beta_sigmoid`). The
backward takes each tile's norm again for the L2 norm's VJP
(`_normed_vjp`), applies the gate's VJP to d log-decay per token
(`_log_decay_vjp`), the sigmoid's to dbeta, and sums a_log's and dt_bias's
gradients over the chunks in resident outputs. The prologue costs the backward about 0.3 MiB of scoped
VMEM (`pallas_mosaic_tpu.vmem_estimate`).

Backward. Pass 1 is the forward kernel without outputs, emitting the state
entering every chunk and T' (bf16 for bf16 inputs: the forward's products
use them rounded to bf16 anyway). Pass 2 walks the chunks in reverse
carrying dS, recomputes Γ and the WY factors from T', and produces every
gradient of the chunk, including d log-decay per token (reverse segmented
cumsum in-kernel).
"""

import dataclasses
import functools
import math
import operator
from typing import Any

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import numerics
from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import prologue

F32, BF16 = jnp.float32, jnp.bfloat16
_NEG_INF = -jnp.inf


# ----------------------------------------------------------------------------
# Precision helpers.
# ----------------------------------------------------------------------------


def _mm(a, b, *, ta=False, tb=False):
  """One MXU pass: a @ b (optionally transposed) with f32 accumulation."""
  dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, preferred_element_type=F32)


def round_bf16(x):
  """x (f32, |x| < 2¹¹¹) rounded to a nearest bf16: (bf16, the same in f32).

  Rounded in f32 arithmetic (Veltkamp's split at 8 significant bits), so the
  bf16 value is an exact cast of the f32 one and never widened back (the v5e
  forms, see the module docstring). Ties may round either way.
  """
  c = x * 65537.0                                   # 2¹⁶ + 1
  wide = c - (c - x)
  return wide.astype(BF16), wide


def _split(x, n, v5e_forms=False):
  """x (f32) as n (bf16, f32) pieces: each f32 piece equals its bf16 one but
  the last, which is the rest (its bf16 piece rounded); the f32 pieces sum
  to x."""
  pieces, rest = [], x
  for _ in range(n - 1):
    if v5e_forms:
      piece, wide = round_bf16(rest)
    else:
      piece = rest.astype(BF16)
      wide = piece.astype(F32)
    pieces.append((piece, wide))
    rest = rest - wide
  return pieces + [(rest.astype(BF16), rest)]


def rounded_bf16(x, n, v5e_forms=False):
  """x (f32) rounded to n bf16 pieces: (the pieces, their sum in f32, exact).

  Products of the pieces on the MXU are exact; `split_bf16` of the sum gives
  pieces with the same exact sum."""
  pieces = _split(x, n, v5e_forms)
  rest = pieces[-1][1]
  last = round_bf16(rest) if v5e_forms else (rest.astype(BF16), rest.astype(BF16).astype(F32))
  pieces = pieces[:-1] + [last]
  return ([piece for piece, _ in pieces],
          functools.reduce(operator.add, [wide for _, wide in pieces]))   # largest first


def split_bf16(x, n, v5e_forms=False):
  """x (f32) as n bf16 pieces whose sum is x (exactly for n = 3)."""
  return [piece for piece, _ in _split(x, n, v5e_forms)]


def stacked_bf16(x, n, v5e_forms=False):
  """(`split_bf16(x, n)` stacked along rows, (n·rows, cols) bf16; its first piece).

  v5e forms: stacked in f32 and cast once (no bf16 concatenation).
  """
  pieces = _split(x, n, v5e_forms)
  if v5e_forms:
    return jnp.concatenate([wide for _, wide in pieces], 0).astype(BF16), pieces[0][0]
  return jnp.concatenate([piece for piece, _ in pieces], 0), pieces[0][0]


def lhs_masked(mask, x, v5e_forms=False):
  """x where mask, else zero, for a matmul's left operand.

  v5e forms: the zero is -0.0 (a select against +0.0 there is folded into a
  masked matmul); the product is the same.
  """
  return jnp.where(mask, x, -0.0 if v5e_forms else 0.0)


def mxu(a, b, *, passes, ta=False, tb=False, v5e_forms=False):
  """a @ b (a transposed if ta, b if tb), f32 accumulation, in `passes` bf16
  passes. A transposed left operand is the MXU's to take (Mosaic's
  transpose_lhs), cheaper than transposing it first on the XLU (`_bwd_kernel`).

  1: both operands rounded to bf16. 3: each f32 operand split hi + lo and
  hi·hi + hi·lo + lo·hi summed (an exact bf16 operand is not split).
  `v5e_forms`: the split by `round_bf16` (module docstring).
  """
  if passes == 1:
    return _mm(a.astype(BF16), b.astype(BF16), ta=ta, tb=tb)
  ah, al = (a, None) if a.dtype == BF16 else split_bf16(a, 2, v5e_forms)
  bh, bl = (b, None) if b.dtype == BF16 else split_bf16(b, 2, v5e_forms)
  out = _mm(ah, bh, ta=ta, tb=tb)
  if bl is not None:
    out = out + _mm(ah, bl, ta=ta, tb=tb)
  if al is not None:
    out = out + _mm(al, bh, ta=ta, tb=tb)
  return out


# ----------------------------------------------------------------------------
# Per-token stages, all heads at once (rows: heads in sublanes, tokens in lanes).
# ----------------------------------------------------------------------------


def chunk_cumsum(x, starts, axis: int = 1):
  """Segment-local inclusive prefix sums along `axis`, compensated.

  x: (H, C) f32 (axis 1, tokens in lanes) or (C, H) (axis 0, tokens in
  sublanes); starts: 1 where a segment starts, (1, C) or (C, 1) as x, or
  None. Returns (hi, lo) with hi + lo the sum to ~f32 precision of each term
  (TwoSum in a Hillis–Steele scan). (The backward's reverse sums are one
  MXU product against the causal mask, `_bwd_kernel`.)
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
  """`chunk_gate` of math.md for every head of a grid step."""

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
  in the forward kernels that is on the critical path (v6e, Qwen3-Next heads,
  T=512: gdn_fwd / gdn_fwd_states 55.6 / 45.7 -> 53.5 / 44.1 k cycles down
  the sublanes), the backward is faster along the lanes (82.8 -> 82.3 k)."""
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
  transposed on its own, took a transpose more per head: v6e, Qwen3-Next
  heads, T=512, gdn_bwd 114.0 -> 120.1 k cycles; gdn_fwd 76.2 -> 75.7 k
  then, but with the paired inverse the forward's critical path runs through
  the XLU, and it is 55.6 -> 56.4 k.)
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
    parts = [wide for _, wide in _split(weights, 3, v5e_forms)]
    # Rows 3..7 repeat the pieces (unused): zero rows made libtpu's v5e
    # estimator abort (a masked matmul of a bf16 operand).
    lhs = jnp.concatenate(parts * 2 + parts[:2], 0).astype(BF16)
  y = _mm(lhs, stacked_bf16(x, pieces, v5e_forms)[0], tb=True)   # (8, pieces C)
  if weights is not None:
    y = jnp.sum(y[0:3], axis=0, keepdims=True)
  return sum(y[0:1, p * c:(p + 1) * c] for p in range(pieces))


# ----------------------------------------------------------------------------
# The inverse.
# ----------------------------------------------------------------------------


def invert_unit_lower(a_list, *, newton, v5e_forms=False):
  """(I + a)⁻¹ for a list of strictly lower-triangular a (C×C f32).

  Level-major over the list (each stage for every matrix before the next),
  so the MXU always has independent work. Pairs: a_{2i} and a_{2i+1}ᵀ share
  one C×C tile (one strictly lower, one strictly upper), and so do their
  inverses (T_{2i} lower, T_{2i+1}ᵀ upper, the unit diagonal shared), so
  that each product of the merges serves two matrices. T0: I − a on the 2×2
  diagonal blocks, then exact block merges T ← T − T a_off T for sizes 2 →
  4 → … → C, in bf16 passes (a whole-chunk Neumann series is unstable:
  powers of a grow like binomials before they cancel; the merges do not).
  The lower matrix's off block (the second half's rows and the first half's
  columns of each 2·size window) and the upper one's (its mirror) are
  disjoint, and so are the rows of the tile each needs right of a_off (the
  lower one's T in each window's first half, the upper one's in the second)
  and left of it (the other way round): a merge level is two C×C products
  per pair. Then `newton` steps T ← T + T (I − (I + a) T) per matrix (the
  upper ones as they are, for (I + aᵀ)⁻¹ = Tᵀ), each of which squares the
  error of T, the residual with a split hi + lo, or with a in bf16 when
  there is one step. Returns (T, transposed) per matrix: an upper one's is
  T_iᵀ, for products that take it transposed (`mxu(ta=True)`, the MXU's to
  do) and stores that transpose it once. `v5e_forms`: see the module
  docstring.

  Accuracy. T0 against the float64 inverse, near-duplicate keys, no decay,
  β ≈ 1 (the hardest case of the inverse test), C = 64 / 128 / 256:
  2.5e-3 / 2.9e-3 / 3.7e-3, and 2.5e-3 / 2.8e-3 / 3.6e-3 after one Newton
  step with a in bf16 (that step's floor): bf16 inputs take no step
  (`default_newton`). (The Neumann sums on 8×8 blocks this start replaced
  left 1.8e-2 / 1.7e-2 / 1.8e-2, which that step was for.)

  Cost. In v6e's estimate a product's MXU time follows the rows of its right
  operand (weights: a 128×128 bf16 one is 8 pushes of 4 cycles on one of the
  two MXUs, whatever the left operand's rows), and one MXU's pushes are most
  of `gdn_fwd`'s critical path. The pairs halve the merges' pushes, but with
  16 heads interleaved a level then has 8 pairs, too few to hide its latency:
  the unrolled kernels invert every head group's matrices in one list
  (`_fwd_chunk`). Qwen3-Next heads, T=512, gdn_fwd / gdn_fwd_states: 64.8 /
  53.8 k cycles (Neumann sums on 8×8 blocks, then merges of the C/2 rows
  they change, one Newton step) -> 62.8 / 51.1 (pairs, all groups in one
  list) -> 57.0 / 47.4 k (no Newton step for bf16); v5e 103 / 82.8 -> 88.7 /
  71.2 k; tpu7x (its head groups in a loop, pairs per group) 86.0 / 130 ->
  81.3 / 127 k.
  """
  c = a_list[0].shape[0]
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  block_of = lambda x, size: lax.shift_right_logical(x, jnp.int32(int(math.log2(size))))
  lower, upper = row >= col, row <= col
  # Pairs: a_{2i} and a_{2i+1}ᵀ in one tile (strictly lower / strictly
  # upper), their inverses T_{2i} and T_{2i+1}ᵀ in one tile z (unit diagonal
  # shared); a last unpaired matrix alone. The tile of the a's is only ever
  # a bf16 operand: transposed in bf16, half the vregs through the XLU
  # (v6e, Qwen3-Next heads, T=512: gdn_fwd / gdn_fwd_states 57.0 / 47.4 ->
  # 56.4 / 46.7 k cycles); not in the v5e forms (16-bit packing).
  pairs = [(a_list[i], a_list[i + 1] if i + 1 < len(a_list) else None)
           for i in range(0, len(a_list), 2)]
  wide = F32 if v5e_forms else BF16
  combs = [a.astype(wide) if an is None else a.astype(wide) + an.astype(wide).T
           for a, an in pairs]
  base = min(2, c)
  eye = (row == col).astype(F32)
  same = block_of(row, base) == block_of(col, base)
  zs = [eye - jnp.where(same, comb, 0.0).astype(F32) for comb in combs]   # 2×2 blocks: I − a
  # Merges size → 2·size, T ← T − T a_off T, both matrices of a pair in one
  # product each: the lower one's off block (second half's rows, first half's
  # columns of each 2·size window) and the upper one's (the mirror) are
  # disjoint, and so are the rows of z each needs on the right (the lower
  # one's T in the first halves, the upper one's in the second) and on the
  # left (the other way round).
  size = base
  while size < c:
    rb, cb = block_of(row, size), block_of(col, size)
    first = (rb & jnp.int32(1)) == 0
    off = (block_of(row, 2 * size) == block_of(col, 2 * size)) & (rb != cb)
    second = jnp.logical_not(first)
    right = (first & lower) | (second & upper)
    left = (first & upper) | (second & lower)
    prods = [_mm(lhs_masked(off, comb, v5e_forms).astype(BF16),
                 jnp.where(right, z, 0.0).astype(BF16)) for comb, z in zip(combs, zs)]
    zs = [z - _mm(lhs_masked(left, z, v5e_forms).astype(BF16), pr.astype(BF16))
          for z, pr in zip(zs, prods)]
    size *= 2
  # (a, T0, strict mask, transposed): an upper one's T0 is T_iᵀ, the inverse
  # of I + a_iᵀ, refined as it is (the same steps, with a_iᵀ).
  heads = []
  for (a, an), z in zip(pairs, zs):
    heads.append((a, z if an is None else jnp.where(lower, z, 0.0), row > col, False))
    if an is not None:
      heads.append((an.T if newton else None, jnp.where(upper, z, 0.0), row < col, True))
  ts = [round_bf16(inv) if v5e_forms else (inv.astype(BF16), None)
        for _, inv, _, _ in heads]                         # (bf16 T, f32 T or None)
  for _ in range(newton):
    staged = []
    for t, (a, _, strict, _) in zip(ts, heads):
      if isinstance(t, tuple):
        t_parts, tf = [t[0]], t[0].astype(F32) if t[1] is None else t[1]
      else:
        t_parts, tf = split_bf16(t, 2, v5e_forms), t
      if newton == 1:
        # One step (bf16 inputs): its residual takes a in bf16 only (one
        # 128-row product, no hi/lo split), so it converges to
        # (I + bf16(a))⁻¹, a within 2⁻⁹ per entry, the perturbation rounding
        # T to bf16 for the products that use it makes anyway. Near-duplicate
        # keys (the inverse test): error 3.6e-6 -> 1.1e-3. v6e, Qwen3-Next
        # heads, T=512: gdn_fwd 80.0 -> 77.0 k cycles. (float32's first of two
        # steps too cost its outputs ~25 % more error on unnormalised keys.)
        a_hi = round_bf16(a)[0] if v5e_forms else a.astype(BF16)
        at = _mm(a_hi, t_parts[0])
      else:
        stacked, a_hi = stacked_bf16(a, 2, v5e_forms)      # [a_hi; a_lo]: one weight push of T
        at2 = _mm(stacked, t_parts[0])
        if len(t_parts) == 1:
          at = at2[:c] + at2[c:]
        else:
          at = at2[:c] + (at2[c:] + _mm(a_hi, t_parts[1]))
      staged.append((t_parts, tf, at, strict))
    ts = []
    for t_parts, tf, at, strict in staged:
      # −(I − (I + a) T), nonzero strictly below the diagonal only (there
      # I's entries are 0), and T − T (that): one negation and one
      # subtraction of I fewer than forming I − (I + a) T (the same values).
      r = jnp.where(strict, tf + at, 0.0).astype(BF16)
      corr = _mm(t_parts[0], r)
      for p in t_parts[1:]:
        corr = corr + _mm(p, r)
      ts.append(tf - corr)
  return [((t[0].astype(F32) if t[1] is None else t[1]) if isinstance(t, tuple) else t,
           transposed) for t, (_, _, _, transposed) in zip(ts, heads)]


# ----------------------------------------------------------------------------
# Kernels.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
  """Compile-time facts shared by the kernels."""

  t_len: int
  chunk: int
  hk: int
  hv: int
  dim_k: int
  dim_v: int
  scale: float
  passes: int
  newton: int
  interleave: int     # value heads per group: a multiple of the GVA group dividing Hv
  has_seg: bool
  has_h0: bool
  n_states: int = 0   # per-segment states (0: a [B, Hv, K, V] state or none)
  # The in-kernel half of `isolation.SegmentGuard` (its gates and states are
  # sanitised in XLA): non-finite k, v (and q, dO in the backward) count as 0.
  sanitize: bool = False
  # The whole `isolation.SegmentGuard` in the kernels (`_guard_*`; not with
  # per-segment states): the raw gates, betas and states come in too, the
  # per-token bad flags are taken from the tiles the kernel loads and carried
  # across the chunks, the tiles are sanitised (the forward's k, v where the
  # head groups read them, `_guard_finite`; the backward's in place in a
  # chunk with a bad token, `_guard_sanitize`), and the outputs,
  # the final state and the gradients of the poisoned tokens are made NaN in
  # VMEM.
  guard: bool = False
  # The op's prologue in the kernel (`prologue.prologue`, from the raw
  # inputs): q, k L2-normalised (`qk_l2norm`, `_normed`); the log-decay
  # -exp(a_log) * softplus(g + dt_bias) of the raw gate (`gate_act`: a_log
  # and dt_bias are the `a_log` and `dt_bias` inputs: `_gate_params`) and floored at
  # `log_decay_floor` (`_log_decay`); beta the sigmoid of the beta input's
  # logits (`beta_sigmoid`, `_beta_block`).
  qk_l2norm: bool = False
  gate_act: bool = False
  log_decay_floor: float | None = None
  beta_sigmoid: bool = False
  # The forward kernels' q, k normalised in place in the head-major scratch
  # before the head groups (tpu7x: less scoped VMEM), else where a head group
  # reads them (faster: v6e, Qwen3-Next heads, T=512, gdn_fwd 80.3 k cycles
  # vs 90.4 k in place; in place, tpu7x's forward at T=32768 with an initial
  # state fits its 21 MiB, where it was 21.14 MiB otherwise).
  qk_in_place: bool = False
  # The head groups unrolled (`_run_groups`): all of them (True), or by this
  # factor. tpu7x: the backward by 2, the forward kernels not (all of them
  # took its forward to 21.08 of its 21 MiB scoped VMEM at Qwen3-Next heads,
  # T=4096, by 2 the context-parallel forward to 21.16).
  unroll_groups: bool | int = False
  interpret: bool = False   # traced for Pallas interpret mode (`_transposed`)
  # `gdn_fwd_requests`: q, k, v are lane ranges of one [T, 2 Hk K + Hv V]
  # input and the output is [B, T, Hv V] (heads are lane slices of a block: no
  # relayout); `beta_guard`: k and v read as 0 at tokens whose beta is 0
  # (`_packed_heads`).
  packed: bool = False
  beta_guard: bool = False
  # `requests`: grid steps are work items (a block and a request touching
  # it) described in SMEM; `gated`: items whose run flag is 0 do nothing
  # (the cost model `all_run` compiles every item ungated).
  requests: bool = False
  gated: bool = False
  # Traced for v5e: the forms libtpu's cycle estimator accepts there (module
  # docstring); the values are the same up to ties in rounding to bf16.
  v5e_forms: bool = False

  @property
  def guard_branched(self) -> bool:
    # v5e: the forward's sanitising in a branch taken in chunks with a bad
    # token (`_guard_sanitize`); elsewhere selects in every chunk where the
    # head groups read the tiles (`_guard_finite`), cheaper there than a
    # branch splitting the unrolled head groups. (The backward's gradient
    # poison branches everywhere: `_guard_bwd_tiles`.) Qwen3-Next heads,
    # T=512, gdn_fwd / gdn_fwd_states k cycles, branched -> not: v6e 75.1 /
    # 63.8 -> 72.4 / 60.7 (the current kernels); before this round's kernel
    # changes (gdn_bwd too, then not branched anywhere): v6e 80.0 / 70.2 /
    # 114.0 -> 77.7 / 67.0 / 113.6, tpu7x 126.2 / 147.4 / 216.0 -> 125.1 /
    # 145.4 / 214.9, v5e (no bf16 VPU) 132.3 / 122.3 / 160.0 -> 134.6 / 123.0
    # / 164.6.
    return self.v5e_forms

  @property
  def group(self) -> int:
    return self.hv // self.hk

  @property
  def mm(self):
    return BF16 if self.passes == 1 else F32

  @property
  def tail(self) -> bool:
    # With `requests` a block's rows past T are outside every item's rows.
    return not self.requests and self.t_len % self.chunk != 0


class _Refs:
  """A kernel's refs by name: the scalar-prefetched chunk codes, then the
  inputs, outputs and scratch buffers as `_call` passes them.

  `_call` names every operand where it builds the operand lists (`_Operand`),
  and the kernel reads them back here by those names, so the order of the
  refs is stated once and cannot drift from the builder. A name the call
  did not pass reads as None (an optional operand: `starts` without
  segments, `h0` without an initial state, ...).
  """

  def __init__(self, names: tuple[str, ...], refs):
    assert len(names) == len(refs), (names, len(refs))
    self._refs = dict(zip(names, refs))

  def __getattr__(self, name):
    if name.startswith("_"):
      raise AttributeError(name)
    return self._refs.get(name)


@dataclasses.dataclass(frozen=True)
class _Operand:
  """One named operand of `_call`: an input (`array`, `block`), an output
  (`block`, `shape`: a ShapeDtypeStruct) or a scratch buffer (`shape`: its
  VMEM type)."""

  name: str
  array: Any = None
  block: Any = None
  shape: Any = None


def _lanes(ref, start: int, width: int, st: _Static, c_idx):
  """Lanes [start, start + width) of a (C, ·) token block in f32, an aligned
  slice (no relayout); rows at or past T zeroed."""
  return _tail_mask(ref[:, start:start + width].astype(F32), st, c_idx)


def _load_heads(ref, scr, st: _Static, c_idx):
  """A (C, H D) block's heads into the head-major f32 scratch `scr` (H, C, D)
  (`_token_block`)."""
  d = scr.shape[-1]
  for j in range(scr.shape[0]):
    scr[j] = _lanes(ref, j * d, d, st, c_idx)


def _store_heads(scr, ref, rows=None):
  """The head-major f32 scratch `scr` (H, C, D) into a (C, H D) block as
  lane slices, in the block's dtype; with `rows` (lo, hi) only those rows
  (the others keep the block's values: `gdn_fwd_requests`' items)."""
  d = scr.shape[-1]
  for j in range(scr.shape[0]):
    lanes = slice(j * d, (j + 1) * d)
    if rows is None:
      ref[:, lanes] = scr[j].astype(ref.dtype)
    else:
      row = lax.broadcasted_iota(jnp.int32, scr.shape[1:], 0)
      ref[:, lanes] = jnp.where((row >= rows[0]) & (row < rows[1]),
                                scr[j].astype(ref.dtype), ref[:, lanes])


def _packed_heads(x_ref, b_ref, qh_scr, kh_scr, vh_scr, st: _Static, c_idx, rows=None):
  """The head tiles of a packed (C, 2 Hk K + Hv V) block into the head-major
  scratch: aligned lane slices of the block (no relayout; q and k are
  L2-normalised later, `_normed`).

  `st.beta_guard`: v of value head u reads as 0 where beta_u is 0, k of a key
  head where beta is 0 on every value head of its group. Exact: a token's k
  and v reach the other tokens' outputs and the state only through its V''
  row, which is used scaled by its beta; a select makes NaN, inf or huge
  values there count as nothing (the serving op's tokens of other requests
  come with beta 0). A query reaches its own output only and is read as it is.
  `rows`: only rows [lo, hi) count (`_row_mask`), the others as beta 0.
  """
  kd, vd, hk = st.dim_k, st.dim_v, st.hk
  live = None
  if st.beta_guard:
    beta = _row_mask(_tail_mask(_beta_block(b_ref, st), st, c_idx), rows)   # (C, Hv)
    live = [beta[:, i:i + 1] != 0.0 for i in range(st.hv)]
  lanes = lambda start, width: _lanes(x_ref, start, width, st, c_idx)
  for j in range(hk):
    q, k = lanes(j * kd, kd), lanes((hk + j) * kd, kd)
    if live is not None:
      heads = live[j * st.group:(j + 1) * st.group]
      k = jnp.where(functools.reduce(jnp.logical_or, heads), k, 0.0)
    qh_scr[j], kh_scr[j] = q, k
  for i in range(st.hv):
    v = lanes(2 * hk * kd + i * vd, vd)
    vh_scr[i] = v if live is None else jnp.where(live[i], v, 0.0)


def _normed(x, st: _Static, scale: float = 1.0):
  """A q or k head tile (C, K) f32 as the kernels use it, with the factor of
  its L2 norm: (x r, r), r = 1 / sqrt(sum(x²) + 1e-6) over each row (C, K)
  under `st.qk_l2norm` (`prologue.l2norm`, in float32 and not rounded to the
  input dtype), else (x, None). Per head tile: a whole block at once costs
  scoped VMEM. The sums are lane reductions: by
  the MXU against ones (three bf16 pieces, as `rowsum_row`) v6e's estimate
  (Qwen3-Next heads, T=512) was 4.1 / 5.4 / 4.5 k cycles more in gdn_fwd /
  gdn_fwd_states / gdn_bwd. `scale`: the tile times scale (the factor r
  as it is)."""
  if not st.qk_l2norm:
    return (x, None) if scale == 1.0 else (x * scale, None)
  r = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + prologue.L2NORM_EPS)
  return x * (r if scale == 1.0 else r * scale), r


def _normed_vjp(normed, dy, scale: float = 1.0):
  """The cotangent of the raw tile from dy, that of `normed = _normed(x,
  scale=scale)` = (scale y, r): scale r (dy - y <y, dy>) per row."""
  y, r = normed
  if r is None:
    return dy if scale == 1.0 else dy * scale
  if scale == 1.0:
    return r * (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True))
  # y here is scale times the normed tile: the scales go on the (C, 1) columns.
  dot_col = jnp.sum(y * dy, axis=-1, keepdims=True) * (1.0 / (scale * scale))
  return (r * scale) * (dy - y * dot_col)


def _beta_block(b_ref, st: _Static):
  """The chunk's betas (C, Hv) f32 from its beta block: with `st.beta_sigmoid`
  the sigmoid of its logits (±inf: 1 and 0; NaN stays NaN, a bad beta)."""
  beta = b_ref[...].astype(F32)
  if st.beta_sigmoid:
    beta = 1.0 / (1.0 + jnp.exp(-beta))
  return beta


def _gate_params(r: "_Refs"):
  """(a_log, dt_bias) as (1, Hv) f32 rows under `st.gate_act`, else None."""
  return None if r.a_log is None else (r.a_log[...], r.dt_bias[...])


def _log_decay(g_ref, params, st: _Static):
  """The chunk's log-decays (C, Hv) f32 from its gate block: the raw gate
  activated under `st.gate_act` (`prologue.gate_log_decay`, a_log and dt_bias
  the rows `params`: `_gate_params`), then, with `st.log_decay_floor`, floored there,
  a non-finite one read as 0 (the guard's bad gates, whose outputs it
  poisons: `isolation.SegmentGuard.sanitize_small`)."""
  g = g_ref[...].astype(F32)
  if st.gate_act:
    g = prologue.gate_log_decay(g, *params)
  if st.log_decay_floor is not None:
    g = jnp.where(jnp.isfinite(g), jnp.maximum(g, st.log_decay_floor), 0.0)
  elif st.guard:
    g = jnp.where(jnp.isfinite(g), g, 0.0)
  return g


def _log_decay_vjp(g_ref, params, st: _Static, d_ld):
  """`_log_decay`'s VJP: from the log-decays' cotangent d_ld (C, Hv), the raw
  gate's and, under `st.gate_act`, the per-token terms of a_log's (d_ld times
  the log-decay; dt_bias's are the gate's), else None. Floored log-decays
  pass none (a tie half, as jnp.maximum's); non-finite ones are the guard's
  (their gradients come poisoned)."""
  g = g_ref[...].astype(F32)
  ld = g
  if st.gate_act:
    a_log, dt_bias = params
    ld = prologue.gate_log_decay(g, a_log, dt_bias)
  if st.log_decay_floor is not None:
    floor = st.log_decay_floor
    d_ld = d_ld * jnp.where(ld > floor, 1.0, jnp.where(ld == floor, 0.5, 0.0))
  if not st.gate_act:
    return d_ld, None
  sigmoid = 1.0 / (1.0 + jnp.exp(-(g + dt_bias)))
  return d_ld * (-jnp.exp(a_log) * sigmoid), d_ld * ld


def _tail_mask(x, st: _Static, c_idx):
  """Zero the rows of tokens at or past T (a partial last block holds garbage)."""
  if not st.tail:
    return x
  pos = c_idx * st.chunk + lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 2)
  return jnp.where(pos < st.t_len, x, 0.0)


def _row_mask(x, rows):
  """Zero the rows of x (C, ...) outside [lo, hi) of `rows` = (lo, hi) (None:
  none): the tokens of a work item's block that are not its request's
  (`gdn_fwd_requests`); with beta and log-decay 0 they pass the state
  through."""
  if rows is None:
    return x
  row = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where((row >= rows[0]) & (row < rows[1]), x, 0.0)


def _finite(x, st: _Static):
  """x with NaN / inf as 0 under `st.sanitize` (one head's tile: a select over
  a whole block costs scoped VMEM)."""
  return lhs_masked(jnp.isfinite(x), x, st.v5e_forms) if st.sanitize else x


def _operand_cat(parts, axis, st: _Static):
  """A matmul operand concatenated from f32 parts: cast to the operand dtype
  part by part, or (v5e forms) concatenated in f32 and cast by `mxu`."""
  if st.v5e_forms:
    return jnp.concatenate(parts, axis)
  return jnp.concatenate([p.astype(st.mm) for p in parts], axis)


def _transposed(x, st: _Static):
  """xᵀ (C×C f32). In interpret mode as products with the identity, exact
  (x's three bf16 pieces): XLA:CPU folds a transpose stored as a residual
  into the backward's transposed-operand product of it, and then cannot run
  that product in bf16 ("Unsupported element type for DotThunk::Execute:
  BF16 x BF16 = F32")."""
  if not st.interpret:
    return x.T
  c = x.shape[0]
  eye = (lax.broadcasted_iota(jnp.int32, (c, c), 0)
         == lax.broadcasted_iota(jnp.int32, (c, c), 1)).astype(BF16)
  return functools.reduce(operator.add, [_mm(eye, piece, tb=True)
                                         for piece in split_bf16(x, 3, st.v5e_forms)])


def _residual(x, ref, st: _Static):
  """x cast for a residual output `ref`. v5e forms: cast from a value of its
  own (x + 0), not the cast a matmul reads in another tiling."""
  return (x + 0.0 if st.v5e_forms else x).astype(ref.dtype)


def _stored_tmat(t, transposed: bool, ref, st: _Static):
  """T' for its residual output `ref`, from `invert_unit_lower`'s (t,
  transposed) pair: t, or tᵀ where t is T'ᵀ. On TPU (but v5e forms) the
  transpose is taken after the cast, in the stored dtype (bf16 for bf16
  inputs: half the vregs through the XLU)."""
  if not transposed:
    return _residual(t, ref, st)
  if st.v5e_forms or st.interpret:
    return _residual(_transposed(t, st), ref, st)
  return t.astype(ref.dtype).T


# ----------------------------------------------------------------------------
# The NaN guard in the kernels (`_Static.guard`): `isolation.SegmentGuard`'s
# flags as rows (heads in sublanes, tokens in lanes), per chunk.
# ----------------------------------------------------------------------------


def _bad_row(x, bf16=False):
  """(1, C) f32: 1 where row c of the tile x (C, D) holds a NaN or inf, else 0.

  The row sums of x·0 (0, or NaN for NaN / inf) by the MXU against ones (as
  `rowsum_row`; NaN propagating as in the forward's poisoned P̃): a lane
  reduction on the vector units costs ~9 cycles per vreg. v6e, Qwen3-Next
  heads, T=512: the forward kernel's k and v rows cost it 0.9 k cycles; the
  XLA reductions of the raw k and v they replace cost 15.7 k.

  `bf16`: x holds bf16 values or values within ±1 (a tile of a bf16 input,
  or its L2-normalised form), so its bf16 cast is finite where x is: x·0 is
  then taken in bf16, half the vregs (v6e, as above: gdn_fwd 75.6 -> 75.2 k,
  gdn_fwd_states 67.0 -> 66.5 k; in the backward it cost 0.1 k more).
  """
  if bf16:
    zeros = x.astype(BF16) * jnp.zeros((), BF16)
  else:
    zeros = (x * 0.0).astype(BF16)
  sums = _mm(jnp.ones((8, x.shape[1]), BF16), zeros, tb=True)[0:1]
  return (sums != sums).astype(F32)


def _bad_flag(x):
  """(1, 1) f32: 1 where the tile x (R, D) holds a NaN or inf (a state's)."""
  return jnp.max(_bad_row(x), axis=1, keepdims=True)


def _guard_finite(x, st: "_Static"):
  """The forward's head tile x (a k or v tile as read from scratch) with NaN /
  inf as 0 under `st.guard`: a select per tile in every chunk, where the
  head groups read it. As a branch on the chunk's flags (`_guard_sanitize`)
  it cost more: the branch splits the unrolled body into basic blocks the
  scheduler cannot overlap (v6e, Qwen3-Next heads, T=512: gdn_fwd 80.0 ->
  77.7 k cycles, gdn_fwd_states 70.2 -> 67.0 k selecting here)."""
  if not st.guard or st.guard_branched:
    return x
  return lhs_masked(jnp.isfinite(x), x, st.v5e_forms)


def _guard_sanitize(flags, tiles, st: "_Static"):
  """Where the chunk has a bad token (`flags` (H, C) f32 > 0 anywhere): the
  head tiles in scratch (`tiles`: refs of (H, C, D)) with NaN / inf as 0, in
  place (the backward's q, k, v, dO). Finite chunks (every chunk of a finite
  run) skip it; as a branch it costs the backward ~0.1 k cycles, as selects
  per tile where the head groups read them (`_guard_finite`) 2.4 k (v6e,
  Qwen3-Next heads, T=512)."""
  @pl.when(jnp.max(flags) > 0.0)
  def _():
    for ref in tiles:
      def head(i, carry, ref=ref):
        x = ref[i]
        ref[i] = lhs_masked(jnp.isfinite(x), x, st.v5e_forms)
        return carry

      lax.fori_loop(0, ref.shape[0], head, 0)


def _poison_tile(nan_row, width: int, st: "_Static"):
  """(C, width) f32: row c NaN where the (1, C) row `nan_row` is NaN, else 0:
  diag(nan_row) @ ones on the MXU (a per-row select of a tile would be a
  lane broadcast), NaN propagating as in the forward's poisoned P̃."""
  c = nan_row.shape[-1]
  diag = (lax.broadcasted_iota(jnp.int32, (c, c), 0)
          == lax.broadcasted_iota(jnp.int32, (c, c), 1))
  return _mm(lhs_masked(diag, nan_row, st.v5e_forms).astype(BF16), jnp.ones((c, width), BF16))


def _poison_diag(x, nan_row, diag, st: "_Static"):
  """The C×C matmul operand x with NaN on its diagonal where the (1, C) row
  `nan_row` is NaN; in the operand's dtype (bf16 for bf16 inputs, but not
  on v5e): half the vregs of an f32 select (v6e, Qwen3-Next heads, T=512:
  gdn_fwd 77.7 -> 75.6 k cycles; tpu7x, its loop not unrolled, 125.1 -> 125.4 k)."""
  if st.mm == BF16 and not st.v5e_forms:
    x, nan_row = x.astype(BF16), nan_row.astype(BF16)
  return jnp.where(diag, x + nan_row, x)


def _nan_where(flags):
  return jnp.where(flags > 0.0, jnp.float32(jnp.nan), 0.0)


def _guard_gate_rows(r: "_Refs", st: "_Static", c_idx):
  """(Hv, C) f32: 1 where the token's raw gate, its log-decay (before the
  floor) or its beta is not finite (`isolation.guard_segments`' `bad_gate`
  and beta; `_log_decay` and `_step_prologue` read them as 0); tail rows 0."""
  g = r.log_decay[...].astype(F32)
  bad = ~jnp.isfinite(g) | ~jnp.isfinite(_beta_block(r.beta, st))
  if st.gate_act:
    bad = bad | ~jnp.isfinite(prologue.gate_log_decay(g, *_gate_params(r)))
  return _tail_mask(bad.astype(F32), st, c_idx).T


def _guard_heads(st: "_Static", per_key_head):
  """Runs per_key_head(j, [value heads of key head j]) for every key head."""
  for j in range(st.hk):
    per_key_head(j, [j * st.group + u for u in range(st.group)])


def _guard_enter(state_ref, s_scr, carry_ref, st: "_Static"):
  """On entering a row: the state `state_ref` (the initial state, or the
  backward's d_final) into `s_scr` with NaN / inf as 0, and per head whether
  it had any into `carry_ref` (zeros without `state_ref`)."""
  if state_ref is None:
    s_scr[...] = jnp.zeros(s_scr.shape, F32)
    carry_ref[...] = jnp.zeros(carry_ref.shape, F32)
    return

  for i in range(st.hv):
    x = state_ref[i].astype(F32)
    s_scr[i] = jnp.where(jnp.isfinite(x), x, 0.0)
    carry_ref[i:i + 1, :] = jnp.broadcast_to(_bad_flag(x), (1, carry_ref.shape[1]))


def _guard_state_out(out_ref, s_scr, flags_ref):
  """out_ref = s_scr, NaN for the heads h whose flags (`flags_ref` (Hv, L))
  are set in lane 0 (a poisoned final state, or initial state's gradient): a
  copy, and where a head is poisoned (never in a finite run) a pass over the
  heads (per head in a loop: 4.2 k cycles on every row, v6e, Hv=32)."""
  out_ref[...] = s_scr[...]

  @pl.when(jnp.max(flags_ref[:, 0:1]) > 0.0)
  def _():
    def head(i, carry):
      out_ref[i] = out_ref[i] + _nan_where(flags_ref[pl.ds(i, 1), 0:1])
      return carry

    lax.fori_loop(0, flags_ref.shape[0], head, 0)


def _guard_fwd_rows(r: "_Refs", st: "_Static", gate: "ChunkGate", causal, c_idx,
                    write_out: bool, emit: bool):
  """The forward's flags of the chunk (`SegmentGuard.running`): a bad k, v,
  gate or beta at or before each token in its segment, or before the chunk
  (`guard_carry`, which this advances to the chunk's last token). Under
  `write_out` `guard_rows` gets the output poison (NaN at those tokens,
  else 0; the query is read as it is: a non-finite one reaches its own
  output only); under `emit` the flags go out for the backward
  (`guard_fwd`). k, v: the head tiles in scratch (tail rows zeroed;
  normalised or raw, non-finite at the same rows), left as they are (the
  head groups read them sanitised, `_guard_finite`)."""
  rows = r.guard_rows
  rows[...] = _guard_gate_rows(r, st, c_idx)

  v_bf16 = r.v.dtype == BF16 and not st.v5e_forms

  def key_head(j, heads):
    k_bad = _bad_row(r.kh[j], r.k.dtype == BF16 and not st.v5e_forms)
    for i in heads:
      rows[pl.ds(i, 1), :] = jnp.maximum(rows[pl.ds(i, 1), :],
                                         jnp.maximum(k_bad, _bad_row(r.vh[i], v_bf16)))

  _guard_heads(st, key_head)
  bad = rows[...]
  if st.guard_branched:
    _guard_sanitize(bad, (r.kh, r.vh), st)
  c = st.chunk
  mask = jnp.where(causal, 1.0, 0.0).astype(BF16)
  count = _mm(bad.astype(BF16), mask, tb=True)          # Σ_{j <= i, same segment} bad_j
  carried = r.guard_carry[:, 0:1]
  if gate.run is not None:      # the segment going on from the last chunk
    carried = jnp.where(gate.run == 0.0, carried, 0.0)
  running = jnp.maximum(jnp.minimum(count, 1.0), carried)
  r.guard_carry[...] = jnp.broadcast_to(running[:, c - 1:c], r.guard_carry.shape)
  if emit:
    r.guard_fwd[...] = running
  if write_out:
    rows[...] = _nan_where(running)


def _guard_bwd_rows(r: "_Refs", st: "_Static", gate: "ChunkGate", causal, leave):
  """The backward's poison of the chunk (`SegmentGuard.gradient_poison`) into
  `guard_rows[0]`, 1 at the tokens whose gradients are NaN: the forward's
  flags (`guard_fwd`), a non-finite query, and a non-finite cotangent (dO,
  or at the row's last token d_final: `guard_carry` at `leave`) of a token
  not poisoned by those, at or after the token in its segment, or after the
  chunk (`guard_carry`, which this moves back to the chunk's first token)."""
  c, rows = st.chunk, r.guard_rows
  fwd = r.guard_fwd[...]

  def key_head(j, heads):
    q_bad = _bad_row(r.qh[j])
    for i in heads:
      before = jnp.maximum(r.guard_fwd[pl.ds(i, 1), :], q_bad)
      rows[0, pl.ds(i, 1), :] = before
      rows[1, pl.ds(i, 1), :] = _bad_row(r.doh[i]) * (1.0 - before)

  _guard_heads(st, key_head)
  _guard_sanitize(rows[0] + rows[1], (r.qh, r.kh, r.vh, r.doh), st)
  mask = jnp.where(causal, 1.0, 0.0).astype(BF16)
  count = _mm(rows[1].astype(BF16), mask)                # Σ_{j >= i, same segment} bad_j
  last = (st.t_len - 1) % c
  carried = r.guard_carry[:, 0:1]
  carried = jnp.where(leave, carried * (1.0 - fwd[:, last:last + 1]), carried)
  if gate.run is not None:      # the segment going on into the next chunk
    carried = jnp.where(gate.run == gate.run[:, c - 1:c], carried, 0.0)
  back = jnp.maximum(jnp.minimum(count, 1.0), carried)
  first = back[:, 0:1]
  if gate.run is not None:      # a segment starting at the chunk's first token ends it
    first = jnp.where(gate.run[:, 0:1] == 0.0, first, 0.0)
  r.guard_carry[...] = jnp.broadcast_to(first, r.guard_carry.shape)
  rows[0] = jnp.maximum(rows[0], back)


def _guard_bwd_tiles(r: "_Refs", st: "_Static"):
  """NaN into the chunk's dq, dk, dv head tiles (scratch) at the poisoned
  tokens (`guard_rows[0]`): dv per value head, dq and dk where any value
  head of the key head's group is (`SegmentGuard.poison_gradients`), in a
  branch taken only in a chunk with a poisoned token, on every generation.
  (It sits after the head groups, not inside an unrolled body. Adding the
  tiles in every chunk instead was the cheaper form once, v6e, Qwen3-Next
  heads, T=512: gdn_bwd 114.0 -> 113.6 k cycles; since this round's leaner
  backward the branch is: v6e 96.8 -> 94.0 k, tpu7x, all heads on one
  device, 183.4 -> 181.0 k.)"""
  rows = r.guard_rows

  def key_head(j, heads):
    key = rows[0, pl.ds(heads[0], 1), :]
    for i in heads:
      flags = rows[0, pl.ds(i, 1), :]
      key = jnp.maximum(key, flags)
      r.dv_heads[i] = r.dv_heads[i] + _poison_tile(_nan_where(flags), st.dim_v, st)
    tile = _poison_tile(_nan_where(key), st.dim_k, st)
    r.dq_heads[j] = r.dq_heads[j] + tile
    r.dk_heads[j] = r.dk_heads[j] + tile

  pl.when(jnp.max(rows[0]) > 0.0)(lambda: _guard_heads(st, key_head))


# Rows of the per-step row scratch (each (Hv, C) f32).
_G_HI, _G_LO, _BETA, _KOUT, _DECAY_CHUNK, _DECAY_OUT = range(6)
_N_ROWS = 6


def _step_prologue(g_ref, b_ref, st_ref, rows_scr, st: _Static, c_idx, rows=None,
                   params=None, scan_axis: int = 0):
  """Gates of the chunk for every head, into `rows_scr`; returns (gate, masks).

  masks: (causal, strict) C×C, with segments restricted to one segment.
  `rows`: see `_row_mask`; `params`: see `_log_decay`; `scan_axis`: see
  `chunk_gate`.
  """
  g_cols = _row_mask(_tail_mask(_log_decay(g_ref, params, st), st, c_idx), rows)
  b_rows = _beta_block(b_ref, st)
  if st.guard:      # a non-finite beta as 0 (its tokens' results come poisoned)
    b_rows = jnp.where(jnp.isfinite(b_rows), b_rows, 0.0)
  b_rows = _row_mask(_tail_mask(b_rows, st, c_idx), rows).T
  starts = None
  if st.has_seg:
    starts = _tail_mask(st_ref[...].astype(F32).T, st, c_idx)     # (C, 1)
  gate = chunk_gate(g_cols, starts, scan_axis)
  rows_scr[_G_HI] = gate.g_hi
  rows_scr[_G_LO] = gate.g_lo
  rows_scr[_BETA] = b_rows
  rows_scr[_KOUT] = gate.decay_out * b_rows            # (decay_out β)_j
  rows_scr[_DECAY_CHUNK] = jnp.broadcast_to(gate.decay_chunk, b_rows.shape)
  rows_scr[_DECAY_OUT] = gate.decay_out
  return gate, (gate.causal, gate.strict)


def _row(rows_scr, kind, i):
  return rows_scr[kind, pl.ds(i, 1), :]


def _group_heads(st: _Static, gi):
  """(value heads u -> index, key heads ku -> index) of head group `gi`."""
  kpg = st.interleave // st.group
  return ({u: gi * st.interleave + u for u in range(st.interleave)},
          {ku: gi * kpg + ku for ku in range(kpg)})


def _run_groups(st: _Static, group, init=0):
  """`group(gi, carry)` for every head group, unrolled under
  `st.unroll_groups`: then one basic block, so
  the scheduler overlaps one group's transposes and broadcasts (XLU) with
  another's matmul chains (the inverse, which has none to hide). v6e,
  Qwen3-Next heads, T=512 (kernel_cases' configs): gdn_fwd 82.8 -> 76.2 k
  cycles, gdn_fwd_states 74.7 -> 66.8 k, gdn_bwd 119.9 -> 118.7 k; v5e
  144.6 / 128.6 / 175.7 -> 133.5 / 122.0 / 165.0 k. tpu7x's backward
  unrolled by 2 (C=64, interleave 4): 246.5 -> 215.0 k. Returns the carry
  (`init` to start)."""
  return lax.fori_loop(0, st.hv // st.interleave, group, init, unroll=st.unroll_groups)


def lane_rowsums(x, lane, pieces=1, v5e_forms=False, *, weighted=None):
  """Row sums of x (C×n f32) in lane `lane` of a (C, 128) tile, zeros
  elsewhere: x (its `pieces` bf16 pieces) against a one-hot column on the
  MXU. Heads' sums add up in one tile, one lane each, and one transpose
  makes them rows (`_bwd_kernel`). The row form, ones against x transposed
  (`rowsum_row`), pushes x as transposed weights, ~7 cycles per pushed vreg
  against 3–4 (v6e; 5.3 k of gdn_bwd's 82.3 k cycles at Qwen3-Next heads,
  T=512, for one piece per head).

  `weighted` (y, w_cols): adds the row sums of y ⊙ w, w a (1, m) row scaling
  y's (C×m, bf16) columns, given as `w_cols` (m, 128) f32 whose lane `lane`
  holds w as a column, exact in bf16: each product y_ij w_j is exact.
  """
  n = x.shape[1]
  one_hot = (lax.broadcasted_iota(jnp.int32, (n, 128), 1) == lane).astype(BF16)
  sums = [_mm(piece, one_hot) for piece in split_bf16(x, pieces, v5e_forms)]
  if weighted is not None:
    y, w_cols = weighted
    w_lane = lax.broadcasted_iota(jnp.int32, w_cols.shape, 1) == lane
    sums.append(_mm(y, lhs_masked(w_lane, w_cols, v5e_forms).astype(BF16)))
  return functools.reduce(operator.add, sums)


def _fwd_kernel(*refs, names: tuple[str, ...], st: _Static, write_out: bool, emit: bool):
  r = _Refs(names, refs)
  code_ref, c_idx = r.code, pl.program_id(1)

  rows = init = run = None
  if st.requests:     # a work item (`_item_table`)
    flags = r.item_flags[c_idx]
    run = (flags & 1) == 1
    enter, leave, init = _flag(flags, 1), _flag(flags, 2), _flag(flags, 3)
    rows = (lax.shift_right_logical(flags, jnp.int32(4)) & 255,
            lax.shift_right_logical(flags, jnp.int32(12)) & 255)

    @pl.when(_flag(flags, 20))
    def _fresh():
      # The first item of its block: the block's rows start as `base`'s (the
      # output updates `base` in place; items merge their rows into it).
      r.out[...] = r.base[...]
  elif st.n_states:   # a segment starts here: its own state (zeros from segment N on)
    code = code_ref[pl.program_id(0) * pl.num_programs(1) + c_idx]
    enter, leave = _code_reset(code) == 1, _code_last(code) == 1
  else:
    enter, leave = c_idx == 0, c_idx == pl.num_programs(1) - 1

  if not st.gated:
    run = None
  _fwd_step(r, st, write_out, emit, enter, leave, init, rows, run)


def _flag(flags, bit: int):
  return (lax.shift_right_logical(flags, jnp.int32(bit)) & 1) == 1


def _fwd_step(r: _Refs, st: _Static, write_out: bool, emit: bool, enter, leave, init, rows,
              run):
  """One chunk of `_fwd_kernel`: `enter`/`leave` (scalars) take the
  initial state / write the final one; with `requests`, `init` says whether
  the initial state is the request's read state (else zeros) and only the
  block's rows [lo, hi) = `rows` are the request's (the others pass the
  state through, and their output rows are left as they are); `run` (None:
  always) gates the whole step. The gate is folded into each branch rather
  than put around them: the state DMAs in a branch nested in another made
  libtpu's static estimator abort ("No DMA issue node found for sync
  flag")."""
  h0_ref, s_scr, c_idx = r.h0, r.s, pl.program_id(1)
  if run is not None:
    enter, leave = jnp.logical_and(run, enter), jnp.logical_and(run, leave)

  @pl.when(enter)
  def _init():
    if st.guard:
      _guard_enter(h0_ref if st.has_h0 else None, s_scr, r.guard_carry, st)
    elif init is None:
      s_scr[...] = h0_ref[...].astype(F32) if st.has_h0 else jnp.zeros(s_scr.shape, F32)
    else:
      # `requests`: the request's read slot of the pool (HBM) by a DMA here,
      # and a select, so a NaN in an unread slot stays out. (As pipelined
      # blocks with SMEM index maps, the state in and out made libtpu's
      # static estimator abort: "No DMA issue node found for sync flag".)
      cp = pltpu.make_async_copy(h0_ref.at[r.item_slot[c_idx]], r.h0_buf, r.sem.at[0])
      cp.start()
      cp.wait()
      s_scr[...] = jnp.where(init, r.h0_buf[...].astype(F32), 0.0)

  if run is None:
    _fwd_chunk(r, st, write_out, emit, rows)
  else:
    pl.when(run)(lambda: _fwd_chunk(r, st, write_out, emit, rows))

  if init is None and r.final is None:   # no final state asked for
    return

  @pl.when(leave)
  def _final():
    if st.guard:
      _guard_state_out(r.final, s_scr, r.guard_carry)
    elif init is None:
      r.final[...] = r.s[...]
    else:   # `requests`: into the request's write slot of the pool, by a DMA
      r.h0_buf[...] = r.s[...].astype(r.h0_buf.dtype)
      cp = pltpu.make_async_copy(r.h0_buf, r.pool.at[r.item_write[c_idx]], r.sem.at[1])
      cp.start()
      cp.wait()


def _fwd_chunk(r: _Refs, st: _Static, write_out: bool, emit: bool, rows):
  """`_fwd_step`'s compute: the chunk's outputs and the state update."""
  q_ref, k_ref, v_ref, g_ref, b_ref = r.q, r.k, r.v, r.log_decay, r.beta
  st_ref, o_ref = r.starts, r.out
  states_ref, tm_ref = r.states, r.tmats
  s_scr, rows_scr, qh_scr, kh_scr, vh_scr, out_scr = r.s, r.rows, r.qh, r.kh, r.vh, r.out_heads
  c, c_idx = st.chunk, pl.program_id(1)
  dim_k = st.dim_k
  dot = functools.partial(mxu, passes=st.passes, v5e_forms=st.v5e_forms)
  poison_ref = (r.guard_rows if st.guard else r.poison) if write_out else None
  gate, masks = _step_prologue(g_ref, b_ref, st_ref, rows_scr, st, c_idx, rows,
                               _gate_params(r))
  _, strict = masks
  # With `sanitize` the keys and values are sanitised per head in `group` (a
  # NaN would reach earlier tokens through 0-coefficients; a select over a
  # whole block took scoped VMEM past the tpu7x limit). A query reaches only
  # its own output, so it stays as it is.
  if st.packed:
    _packed_heads(r.qkv, b_ref, qh_scr, kh_scr, vh_scr, st, c_idx, rows)
  else:
    # The states pass (no outputs) reads no queries: they reach the outputs
    # only (v6e, Qwen3-Next heads, T=512: gdn_fwd_states 60.7 -> 57.0 k
    # cycles without their copy, norm and half of [Q; K] Kᵀ).
    for ref, scr in ((q_ref, qh_scr), (k_ref, kh_scr), (v_ref, vh_scr))[0 if write_out else 1:]:
      _load_heads(ref, scr, st, c_idx)
  if st.qk_l2norm and st.qk_in_place:
    def normalise(j, carry):
      if write_out:
        qh_scr[j] = _normed(qh_scr[j], st)[0]
      kh_scr[j] = _normed(kh_scr[j], st)[0]
      return carry

    lax.fori_loop(0, st.hk, normalise, 0)
  if st.guard:
    _guard_fwd_rows(r, st, gate, masks[0], c_idx, write_out, emit)
  if poison_ref is not None:
    c_iota = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    diag = c_iota == lax.broadcasted_iota(jnp.int32, (c, c), 1)

  def prepare(gi):
    """A head group's state-independent part up to A' (the inverse's input)."""
    heads, kheads = _group_heads(st, gi)
    kj = lambda u: u // st.group
    norm = (lambda x: x) if st.qk_in_place else (lambda x: _normed(x, st)[0])
    q = {ku: norm(qh_scr[j]) for ku, j in kheads.items()} if write_out else None
    k = {ku: _finite(norm(_guard_finite(kh_scr[j], st)), st) for ku, j in kheads.items()}
    beta = {u: _row(rows_scr, _BETA, i) for u, i in heads.items()}
    gammas, dins = {}, {}
    for u, i in heads.items():
      gammas[u], dins[u] = gamma_decay_in(
          (_row(rows_scr, _G_HI, i), _row(rows_scr, _G_LO, i), gate.run), masks, dim_k)
    qkk = {ku: dot(jnp.concatenate([q[ku], k[ku]], 0) if write_out else k[ku], k[ku], tb=True)
           for ku in kheads}                               # [Q; K] Kᵀ, or K Kᵀ
    kk = lambda ku: qkk[ku][c:] if write_out else qkk[ku]
    # Γ ⊙ β_j once for A' and P̃ (v6e, Qwen3-Next heads, T=512: gdn_fwd -0.4 k cycles)
    gbs = {u: gammas[u] * beta[u] for u in heads}
    a_list = [jnp.where(strict, kk(kj(u)) * gbs[u], 0.0) for u in heads]
    return dict(q=q, k=k, dins=dins, qkk=qkk, gbs=gbs, a_list=a_list)

  def finish(gi, pre, t_list):
    """A head group's outputs and state update, given its T' = (I + M D_β)⁻¹."""
    heads, kheads = _group_heads(st, gi)
    kj = lambda u: u // st.group
    q, k, dins, qkk, gbs = (pre[n] for n in ("q", "k", "dins", "qkk", "gbs"))
    tmats = dict(zip(heads, t_list))        # (T' or T'ᵀ, transposed)
    v = {u: _finite(_guard_finite(vh_scr[i], st), st) for u, i in heads.items()}
    s = {u: s_scr[i] for u, i in heads.items()}
    # V″ = Ũ − W̃ S = T' (V − K_in S): the forward needs no W̃, so two
    # products, not three, and the first does not wait for the inverse. v6e,
    # Qwen3-Next heads, T=512: gdn_fwd 74.8 -> 73.6 k cycles, gdn_fwd_states
    # 66.1 -> 64.8 k (v5e 133.5 / 121.9 -> 130.2 / 117.5 k).
    x_in = {u: v[u] - dot(k[kj(u)] * dins[u], s[u]) for u in heads}   # V − K_in S
    v_new = {u: dot(tmats[u][0], x_in[u], ta=tmats[u][1]) for u in heads}   # V″
    if write_out:
      for u, i in heads.items():
        p_tilde = qkk[kj(u)][:c] * gbs[u]
        if poison_ref is not None:
          # NaN on the diagonal of a poisoned token's row: it meets that
          # token's own V″ row only, so exactly its output turns NaN (a
          # column row, a sublane broadcast; a per-row select of the output
          # would be a lane broadcast).
          p_tilde = _poison_diag(p_tilde, poison_ref[pl.ds(i, 1), :], diag, st)
        lhs = _operand_cat([q[kj(u)] * dins[u], p_tilde], 1, st)
        rhs = _operand_cat([s[u], v_new[u]], 0, st)
        out_scr[i] = st.scale * dot(lhs, rhs)
    k_t = {ku: k[ku].T for ku in kheads}
    for u, i in heads.items():
      lam = _row(rows_scr, _DECAY_CHUNK, i)[:, 0:1]
      s_scr[i] = lam * s[u] + dot(k_t[kj(u)] * _row(rows_scr, _KOUT, i), v_new[u])
      if emit:
        states_ref[i] = _residual(s[u], states_ref, st)
        tm_ref[i] = _stored_tmat(*tmats[u], tm_ref, st)

  invert = functools.partial(invert_unit_lower, newton=st.newton, v5e_forms=st.v5e_forms)
  if st.unroll_groups is True:
    # Unrolled: every group's inverse level-major in one list (twice the
    # independent products per level; see `invert_unit_lower`).
    pres = [prepare(gi) for gi in range(st.hv // st.interleave)]
    t_all = invert([a for pre in pres for a in pre["a_list"]])
    for gi, pre in enumerate(pres):
      finish(gi, pre, t_all[gi * st.interleave:(gi + 1) * st.interleave])
  else:
    def group(gi, carry):
      pre = prepare(gi)
      finish(gi, pre, invert(pre["a_list"]))
      return carry

    _run_groups(st, group)
  if write_out:
    # Consecutive items of one block (`requests`: a request's last, the next
    # one's first) share the resident output block: each merges its own rows.
    _store_heads(out_scr, o_ref, rows)


def _bwd_kernel(*refs, names: tuple[str, ...], st: _Static):
  r = _Refs(names, refs)
  code_ref, q_ref, k_ref, v_ref, g_ref, b_ref = r.code, r.q, r.k, r.v, r.log_decay, r.beta
  st_ref, states_ref, tm_ref, do_ref, dht_ref = r.starts, r.states, r.tmats, r.d_out, r.d_final
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref = (
      r.dq, r.dk, r.dv, r.d_gate, r.dbeta, r.d_h0)
  ds_scr, rows_scr, qh_scr, kh_scr, vh_scr, doh_scr = r.ds, r.rows, r.qh, r.kh, r.vh, r.doh
  dq_scr, dk_scr, dv_scr = r.dq_heads, r.dk_heads, r.dv_heads
  dgr_scr, dbr_scr = r.dg_rows, r.db_rows
  c, c_idx = st.chunk, pl.num_programs(1) - 1 - pl.program_id(1)
  dim_k = st.dim_k
  dot = functools.partial(mxu, passes=st.passes, v5e_forms=st.v5e_forms)

  if st.n_states:     # the segment ends here: dS is its final state's cotangent
    code = code_ref[pl.program_id(0) * pl.num_programs(1) + c_idx]
    leave, enter = _code_last(code) == 1, _code_reset(code) == 1
  else:
    leave, enter = pl.program_id(1) == 0, pl.program_id(1) == pl.num_programs(1) - 1

  @pl.when(leave)
  def _init():
    if st.guard:
      _guard_enter(dht_ref, ds_scr, r.guard_carry, st)
    else:
      ds_scr[...] = dht_ref[...].astype(F32)

  gate, masks = _step_prologue(g_ref, b_ref, st_ref, rows_scr, st, c_idx,
                               params=_gate_params(r), scan_axis=1)
  causal, strict = masks
  for ref, scr in ((q_ref, qh_scr), (k_ref, kh_scr), (v_ref, vh_scr), (do_ref, doh_scr)):
    _load_heads(ref, scr, st, c_idx)
  if st.guard:
    _guard_bwd_rows(r, st, gate, causal, leave)
  lane = lax.broadcasted_iota(jnp.int32, (1, c), 1)
  # bf16 inputs: the row sums of f ⊙ β (d_gcum's, below) as columns, with β
  # rounded to bf16, laid out as columns once: β's rows against the one-hot
  # (Hv, 128), transposed on the MXU (lane i: head i's β column, exact).
  f_cols = st.passes == 1
  if f_cols:
    b_rows = rounded_bf16(rows_scr[_BETA], 1, st.v5e_forms)[0][0]
    b_cols = _mm(b_rows, (lax.broadcasted_iota(jnp.int32, (st.hv, 128), 0)
                          == lax.broadcasted_iota(jnp.int32, (st.hv, 128), 1)).astype(BF16),
                 ta=True)

  def group(gi, carry):
    heads, kheads = _group_heads(st, gi)
    kj = lambda u: u // st.group
    # The attention scale goes on the queries (the L2 norm's (C, 1) factor), not
    # on every value head's dO: the gradients are the same, dq's scale is
    # `_normed_vjp`'s. v6e, Qwen3-Next heads, T=512: gdn_bwd 103.1 -> 102.7 k cycles.
    q = {ku: _finite(_normed(qh_scr[j], st, st.scale)[0], st) for ku, j in kheads.items()}
    k = {ku: _finite(_normed(kh_scr[j], st)[0], st) for ku, j in kheads.items()}
    k_t = {ku: k[ku].T for ku in kheads}
    v = {u: _finite(vh_scr[i], st) for u, i in heads.items()}
    d_o = {u: _finite(doh_scr[i], st) for u, i in heads.items()}
    # The residuals as stored (bf16 for bf16 inputs): as matmul operands only,
    # not widened to f32 and cast back (S in f32 for ⟨S, dS⟩ is a load of its own).
    s = {u: states_ref[i] for u, i in heads.items()}
    tm = {u: tm_ref[i] for u, i in heads.items()}
    dsn = {u: ds_scr[i] for u, i in heads.items()}
    beta = {u: _row(rows_scr, _BETA, i) for u, i in heads.items()}
    kout = {u: _row(rows_scr, _KOUT, i) for u, i in heads.items()}
    lam = {u: _row(rows_scr, _DECAY_CHUNK, i)[:, 0:1] for u, i in heads.items()}
    # Γ and decay_in from the compensated G for float32 inputs; for bfloat16
    # inputs from its float32 part alone: off by up to a few float32 ulps of
    # |G| (relative 6e-4 in Γ where |G| ~ 2000 at the −30 floor), below the
    # bfloat16 rounding of the inputs, for one transpose (XLU) and three vector
    # passes less per head (v6e, Qwen3-Next heads, T=512: gdn_bwd 101.6 -> 99.3 k
    # cycles).
    gammas, dins, dins_v = {}, {}, {}
    for u, i in heads.items():
      g_lo = _row(rows_scr, _G_LO, i) if st.passes > 1 else None
      gammas[u], dins[u], dins_v[u] = gamma_decay_in(
          (_row(rows_scr, _G_HI, i), g_lo, gate.run), masks, dim_k, st.dim_v)
    qkk = {ku: dot(jnp.concatenate([q[ku], k[ku]], 0), k[ku], tb=True)
           for ku in kheads}
    # Forward recompute: [W̃ | Ũ] = T' [K_in | V], V″ = Ũ − W̃ S.
    wu = {u: dot(tm[u], _operand_cat([k[kj(u)] * dins[u], v[u]], 1, st))
          for u in heads}
    v_new = {u: wu[u][:, dim_k:] - dot(wu[u][:, :dim_k], s[u]) for u in heads}
    ngb = {u: gammas[u] * -beta[u] for u in heads}                      # −Γ ⊙ β_j
    # State part: −dV″ = −P̃ᵀ dO − (K ⊙ kout_i) dS′ (the sign from β's and
    # kout's rows, so that dS = Q_inᵀ dO + W̃ᵀ (−dV″) + λ dS′ and [dO Sᵀ; dW̃]
    # take it as it is).
    # The transposed products take their left operands as they are (ta): v6e,
    # Qwen3-Next heads, T=512, gdn_bwd 118.7 -> 109.5 k cycles against
    # transposing them first (XLU).
    # Every stacked operand by `_operand_cat`, so that a tile stacked into
    # several (dO, dS, −dV″) is cast to bf16 once.
    nd_vnew = {}
    for u in heads:
      k_db = -kout[u] * k_t[kj(u)]                                     # −(K ⊙ (decay_out β)_i)ᵀ
      nd_vnew[u] = dot(_operand_cat([qkk[kj(u)][:c] * ngb[u], k_db], 0, st),   # −P̃ ⊙ β_j
                       _operand_cat([d_o[u], dsn[u]], 0, st), ta=True)
    # decay_in on dO's rows (Q_inᵀ dO = Qᵀ (decay_in ⊙ dO)), which then
    # reaches dq's part, dO_in Sᵀ, too: one C×K pass per head less than on Q
    # and on dO Sᵀ (v6e, Qwen3-Next heads, T=512: gdn_bwd 99.4 -> 98.5 k cycles).
    d_oin = {u: d_o[u] * dins_v[u] for u in heads}
    for u, i in heads.items():
      lhs = _operand_cat([q[kj(u)], wu[u][:, :dim_k]], 0, st)
      ds_scr[i] = lam[u] * dsn[u] + dot(lhs, _operand_cat([d_oin[u], nd_vnew[u]], 0, st),
                                        ta=True)
    dqw = {u: dot(_operand_cat([d_oin[u], nd_vnew[u]], 0, st), s[u], tb=True)
           for u in heads}                                              # [dO_in Sᵀ; dW̃]
    dpk = {u: dot(_operand_cat([d_o[u], dsn[u]], 0, st), v_new[u], tb=True)
           for u in heads}                                              # [dP̃; d(Kᵀ kout)]
    # WY part: [dK_in | dV] = T'ᵀ [dW̃ | dŨ];  dA' = −[dK_in | dV] [W̃ | Ũ]ᵀ.
    d_xin = {u: dot(tm[u], _operand_cat([dqw[u][c:], -nd_vnew[u]], 1, st), ta=True)
             for u in heads}
    n_da = {u: jnp.where(strict, dot(d_xin[u], wu[u], tb=True), 0.0)   # −dA'
            for u in heads}
    # Sums per key head, started by their first term (no adds of zeros).
    # d_QK, d_KK and d(K_out) are summed over a key head's value heads
    # before the products with Q and K and the transpose: one per key head.
    dq_acc, dk_acc, dqk_sum, dkb_sum = {}, {}, {}, {}
    acc = lambda sums, ku, x: x if ku not in sums else sums[ku] + x
    f_pieces = 1 if f_cols else 2     # f's bf16 pieces (below)
    for u, i in heads.items():
      ku = kj(u)
      d_p, d_kb = dpk[u][:c], dpk[u][c:]
      dv_scr[i] = d_xin[u][:, dim_k:]
      d_kk = n_da[u] * ngb[u]                                          # dA' ⊙ β_j Γ
      nd_qk = lhs_masked(causal, d_p * ngb[u], st.v5e_forms)           # −d_QK
      dqk_sum[ku] = acc(dqk_sum, ku, jnp.concatenate([nd_qk, d_kk], 0))
      dkb_sum[ku] = acc(dkb_sum, ku, d_kb * kout[u])
      # dΓ ⊙ Γ = f ⊙ β_j with f = dA' ⊙ M + dP̃ ⊙ P̃ = Γ ⊙ (dP̃ ⊙ QKᵀ + dA' ⊙ KKᵀ);
      # dβ_j gets colsum(f).
      # f is rounded to the bf16 pieces its row sums take on the MXU, and
      # its column sums are taken of that (see d_gcum's row below).
      f_bf16, f = rounded_bf16(gammas[u] * (d_p * qkk[ku][:c] - n_da[u] * qkk[ku][c:]),
                               f_pieces, st.v5e_forms)
      f_col = jnp.sum(f, axis=0, keepdims=True)
      dk_in = d_xin[u][:, :dim_k] * dins[u]
      dq_acc[ku] = acc(dq_acc, ku, dqw[u][:c])
      dk_acc[ku] = acc(dk_acc, ku, dk_in)
      # Per-token parts of dβ and d_gcum (math.md), as rows.
      d_kout = jnp.sum(d_kb * k_t[ku], axis=0, keepdims=True)          # d(decay_out β)_j
      decay_out = _row(rows_scr, _DECAY_OUT, i)
      d_dout = d_kout * kout[u]                                          # d decay_out · decay_out
      d_lam = jnp.sum(dsn[u] * states_ref[i].astype(F32)) * lam[u]
      dbr_scr[pl.ds(i, 1), :] = f_col + d_kout * decay_out
      dgr_scr[pl.ds(i, 1), :] = (
          # rowsum(e) − colsum(e) cancels in every suffix sum of d_gcum (all of
          # e's pairs inside it): the row sums must be exact sums of the
          # terms the column sums add, else a truncation (~2⁻¹⁶ of e for hi +
          # lo) is left in every token's dg, large next to a strongly
          # decaying head's tiny true dg. So f is rounded to its pieces
          # first: each product with β's pieces is exact, and the rounding
          # (2⁻⁹ of f for bf16 inputs, 2⁻¹⁶ for float32) moves both sums
          # alike. bf16 inputs: one piece, and β rounded to bf16 on both
          # sides, the row sums as columns in the carried tile (below);
          # float32: two pieces against β's three, as a row. v6e,
          # Qwen3-Next heads, T=512: gdn_bwd 80.0 k cycles with f's three
          # pieces as a row, 78.2 k with one, 77.3 k as columns (77.5 k
          # stacked with decay_in's part in one product, 77.6 k selecting β's
          # column in bf16, 79.1 k rounding f ⊙ β as one tile instead).
          (-rounded_bf16(beta[u], 1, st.v5e_forms)[1] * f_col if f_cols else
           rowsum_row(f, pieces=f_pieces, weights=beta[u], v5e_forms=st.v5e_forms)
           - beta[u] * f_col)
          - d_dout
          + jnp.where(lane == c - 1, jnp.sum(d_dout) + d_lam, 0.0))
      # decay_in's part, into lane i of the carried columns (`lane_rowsums`):
      # no cancellation to keep, so one bf16 piece for bf16 inputs (v6e,
      # Qwen3-Next heads, T=512: gdn_bwd 98.5 -> 97.3 k cycles; rel-RMS of
      # a_log's / dt_bias's gradient in the bf16 case of pallas_mosaic_tpu_test
      # 6.6e-3 / 6.9e-3 -> 7.3e-3 / 7.6e-3, of 2e-2), two for float32.
      carry = carry + lane_rowsums(dk_in * k[ku] + dqw[u][:c] * q[ku], i,
                                   pieces=1 if st.passes == 1 else 2, v5e_forms=st.v5e_forms,
                                   weighted=(f_bf16[0], b_cols) if f_cols else None)
    for ku in kheads:
      both = dot(dqk_sum[ku], k[ku])                                   # [−d_QK K; d_KK K]
      back = dot(dqk_sum[ku], jnp.concatenate([-q[ku], k[ku]], 0), ta=True)
      dq_acc[ku] = dq_acc[ku] - both[:c]
      dk_acc[ku] = dk_acc[ku] + both[c:] + back + dkb_sum[ku].T
    for ku, j in kheads.items():
      # The VJP at the sanitised q, k (they differ at non-finite rows only,
      # whose gradients come poisoned), the norms taken again: kept from the
      # start, they took tpu7x's backward past its scoped VMEM limit
      # (Qwen3-Next heads, T=4096, C=64: 21.10 of 21 MiB), and v6e's estimate
      # gained nothing (Qwen3-Next heads, T=512: gdn_bwd 99.4 -> 99.6 k cycles).
      dq_scr[j] = _normed_vjp((q[ku], _normed(qh_scr[j], st)[1]), dq_acc[ku], st.scale)
      dk_scr[j] = _normed_vjp((k[ku], _normed(kh_scr[j], st)[1]), dk_acc[ku])
    return carry

  in_cols = _run_groups(st, group, jnp.zeros((c, 128), F32))
  d_gcum = dgr_scr[...] + in_cols.T[:st.hv]
  # d_gcum's reverse cumsum in the segment, d_g_j = Σ_{i ≥ j, same segment}
  # d_gcum_i, as d_gcum @ causal on the MXU (three bf16 pieces: exact products,
  # float32 sums): v6e, Qwen3-Next heads, T=512, 3.9 k cycles of gdn_bwd as a
  # compensated scan over lanes (`chunk_cumsum`, a dependent chain).
  # (A product per piece: Hv rows need not be a multiple of bf16's 16.)
  mask = lhs_masked(causal, jnp.ones((c, c), F32), st.v5e_forms).astype(BF16)
  d_g = functools.reduce(operator.add, [
      _mm(piece, mask) for piece in split_bf16(d_gcum, 3, st.v5e_forms)])
  if st.guard:      # NaN into every gradient of the poisoned tokens
    _guard_bwd_tiles(r, st)
    poison = _nan_where(r.guard_rows[0])
    d_g = d_g + poison
    dbr_scr[...] = dbr_scr[...] + poison
  d_gate, d_a_log = _log_decay_vjp(g_ref, _gate_params(r), st, d_g.T)
  dg_ref[...] = d_gate.astype(dg_ref.dtype)
  if d_a_log is not None:
    # a_log's and dt_bias's gradients, summed over the row's chunks in the
    # resident output block (per-token terms took tpu7x past its VMEM; per
    # chunk parts and dg in float32 for XLA to sum cost two fusions and a
    # convert: v6e, Qwen3-Next heads, T=512, 2.7 k cycles of glue; one
    # stacked [B, 2, Hv] output cost a slicing fusion, 0.5 k). A select, not
    # a branch, starts the sums (the block holds garbage at the first chunk):
    # the two branches cost 0.8 k cycles less but 2 KiB more scoped VMEM,
    # which took the backward of Qwen3-Next's heads split over tpu7x's two
    # devices at T=4096 past its 21 MiB.
    for ref, x in ((r.d_a_log, d_a_log), (r.d_dt_bias, d_gate)):
      before = jnp.where(pl.program_id(1) == 0, 0.0, ref[...])
      ref[...] = before + jnp.sum(_tail_mask(x, st, c_idx), axis=0, keepdims=True)
  d_beta = dbr_scr[...]
  if st.beta_sigmoid:     # the sigmoid's VJP: beta (1 - beta) from the chunk's rows
    beta = rows_scr[_BETA]
    d_beta = d_beta * (beta * (1.0 - beta))
  db_ref[...] = d_beta.T.astype(db_ref.dtype)
  for ref, scr in ((dq_ref, dq_scr), (dk_ref, dk_scr), (dv_ref, dv_scr)):
    _store_heads(scr, ref)

  if dh0_ref is None:    # no initial state: no gradient of it
    return

  @pl.when(enter)
  def _final():
    if st.guard:    # a segment's initial state counts as its first token's input
      _guard_state_out(dh0_ref, ds_scr, r.guard_rows.at[0])
    else:
      dh0_ref[...] = ds_scr[...]


# ----------------------------------------------------------------------------
# Wrappers.
# ----------------------------------------------------------------------------


def _starts(segment_ids):
  """[B, 1, T] int32: 1 where a segment starts (never at t = 0)."""
  return segments.segment_starts(segment_ids).astype(jnp.int32)[:, None, :]


# Per-segment states: one int32 code per chunk, read from SMEM (scalar
# prefetch) by the kernels and by the index maps of the state blocks.
def _code_slot(code):
  """The state slot of the chunk's segment: min(segment, N); slot N is zeros."""
  return lax.shift_right_logical(code, jnp.int32(2))


def _code_reset(code):
  """1 where a segment starts at the chunk: the state entering it is its slot's."""
  return lax.shift_right_logical(code, jnp.int32(1)) & 1


def _code_last(code):
  """1 where the chunk is its segment's last: the state leaving it is its slot's."""
  return code & 1


@dataclasses.dataclass(frozen=True)
class _Segments:
  """Per-segment states ([B, N, Hv, K, V]) on the chunk-aligned layout of
  `segments.align_segments`: every segment n < N starts at a chunk boundary, so a
  chunk either continues the state or takes its segment's own (`_code_*`);
  later segments start in-chunk from zeros (the kernels' segment masks).
  """

  layout: segments.SegmentLayout
  code: jax.Array      # [B * Nc] int32: slot * 4 + reset * 2 + last

  @classmethod
  def build(cls, segment_ids, n_states: int, chunk: int) -> "_Segments":
    layout = segments.align_segments(segment_ids, n_states, chunk)
    slot = jnp.minimum(layout.chunk_segment, n_states)
    code = (slot * 4 + layout.chunk_reset.astype(jnp.int32) * 2
            + layout.chunk_last.astype(jnp.int32))
    return cls(layout, code.reshape(-1))

  @property
  def n_states(self) -> int:
    return self.layout.num_states

  def starts(self):
    """[B, 1, Ta] int32: the in-chunk starts (segments past N)."""
    return self.layout.in_chunk_starts().astype(jnp.int32)[:, None, :]

  def with_zero_slot(self, states):
    """[B, N, ...] -> [B, N + 1, ...] f32, slot N zeros (segments from N on)."""
    states = states.astype(F32)
    return jnp.concatenate([states, jnp.zeros_like(states[:, :1])], axis=1)

  def per_segment(self, states):
    """The kernel's [B, N + 1, ...] -> [B, N, ...], zeros past each row's
    segments (slots the kernel never wrote)."""
    n = self.n_states
    used = jnp.arange(n)[None, :] < self.layout.num_segments[:, None]
    return jnp.where(used[:, :, None, None, None], states[:, :n], 0.0)


def normalize_interleave(requested: int, hv: int, group: int) -> int:
  """The largest multiple of the GVA group dividing Hv, at most `requested`
  (at least one group)."""
  ok = [n for n in range(group, hv + 1, group) if hv % n == 0]
  return max([n for n in ok if n <= requested] or [ok[0]])


def _v5e_forms() -> bool:
  """Whether the kernels are traced for v5e (`_Static.v5e_forms`)."""
  return gdn_config.target_generation().name == "v5e"


def _unroll_groups(backward: bool = False) -> bool | int:
  """How the head groups are unrolled (`_Static.unroll_groups`)."""
  if gdn_config.target_generation().name != "tpu7x":
    return True
  return 2 if backward else False


@dataclasses.dataclass(frozen=True)
class Prologue:
  """The op's prologue (`prologue.prologue`), run in the kernels: with it
  they take the raw q, k and gate and L2-normalise / activate / floor them
  themselves (`_Static.qk_l2norm`, `gate_act`, `log_decay_floor`). a_log and
  dt_bias: [Hv] arrays or None (dt_bias None with a_log: 0)."""

  qk_l2norm: bool = False
  a_log: jax.Array | None = None
  dt_bias: jax.Array | None = None
  log_decay_floor: float | None = None
  beta_sigmoid: bool = False

  def static(self) -> dict:
    return dict(qk_l2norm=self.qk_l2norm, gate_act=self.a_log is not None,
                log_decay_floor=self.log_decay_floor, beta_sigmoid=self.beta_sigmoid)

  def gate_params(self) -> tuple[jax.Array, jax.Array] | None:
    """(a_log, dt_bias) as [1, Hv] f32 (the kernels' inputs of those names;
    two inputs, not one stacked [2, Hv]: the stack was an XLA fusion of its
    own, 0.6 k cycles per call on v6e), or None."""
    if self.a_log is None:
      return None
    a_log = self.a_log.astype(F32).reshape(1, -1)
    dt = jnp.zeros_like(a_log) if self.dt_bias is None else self.dt_bias.astype(F32).reshape(1, -1)
    return a_log, dt


def default_newton(passes: int) -> int:
  """Newton steps of the inverse (`invert_unit_lower`): none for bf16 inputs
  (its start is as close as one step with a in bf16 gets), two for float32."""
  return 0 if passes == 1 else 2


def _static(q, v, *, scale, chunk, interleave, newton, has_seg, has_h0, n_states=0,
            pro: Prologue = Prologue()):
  b, t, hk, dim_k = q.shape
  hv, dim_v = v.shape[2], v.shape[3]
  passes = 1 if q.dtype == BF16 else 3
  if newton is None:
    newton = default_newton(passes)
  return _Static(t_len=t, chunk=chunk, hk=hk, hv=hv, dim_k=dim_k, dim_v=dim_v,
                 scale=float(scale), passes=passes, newton=newton,
                 interleave=normalize_interleave(interleave, hv, hv // hk),
                 has_seg=has_seg, has_h0=has_h0, n_states=n_states, v5e_forms=_v5e_forms(),
                 qk_in_place=gdn_config.target_generation().name == "tpu7x",
                 unroll_groups=_unroll_groups(), **pro.static())


def _head_scratch(st: _Static, values: tuple[str, ...]) -> list[_Operand]:
  """Row scratch and head-major f32 copies: q, k, then the (Hv, C, V) arrays
  named in `values`."""
  return ([_Operand("rows", shape=pltpu.VMEM((_N_ROWS, st.hv, st.chunk), F32)),
           _Operand("qh", shape=pltpu.VMEM((st.hk, st.chunk, st.dim_k), F32)),
           _Operand("kh", shape=pltpu.VMEM((st.hk, st.chunk, st.dim_k), F32))]
          + [_Operand(n, shape=pltpu.VMEM((st.hv, st.chunk, st.dim_v), F32)) for n in values])


def _token_block(st: _Static, chunk_of, *dims: int) -> pl.BlockSpec:
  """The BlockSpec of one chunk of a [B, T, *dims] array: chunk `chunk_of(i)`
  at grid step (b, i). Index maps take (b, i, *scalar_prefetch_refs).

  Per-head arrays ([B, T, H, D]: q, k, v, the output, their gradients) go to
  the kernels flat, [B, T, H D] (`_flat`), their blocks (C, H D): a head is
  an aligned lane slice of the block (`_load_heads`, `_store_heads`). As
  (C, H, D) blocks, tiled over (H, D), each head's rows were strided, and
  the kernels relaid each block out head-major (`einshape`) and the outputs
  back. v6e, Qwen3-Next heads, T=512, the layer's call
  (`workload.layer_fns`): gdn_fwd / gdn_fwd_states / gdn_bwd 72.5 / 57.0 /
  94.0 -> 65.7 / 54.9 / 82.3 k cycles. The reshape is free where the arrays
  come from a projection, as in the layer (XLA lays the [B, T, H D] product
  out for the kernel); a [B, T, H, D] argument at a jit boundary, in the
  default layout tiled over (H, D), is copied into it by XLA.
  """
  return pl.BlockSpec((None, st.chunk, *dims),
                      lambda b, i, *_: (b, chunk_of(i)) + (0,) * len(dims))


def _flat(x):
  """[B, T, H, D] -> [B, T, H D] (`_token_block`)."""
  return x.reshape(*x.shape[:2], -1)


def _common_inputs(q, k, v, log_decay, beta, starts, st: _Static, chunk_of,
                   poison=None, pro: Prologue = Prologue()) -> list[_Operand]:
  """The inputs both kernels read per chunk (array and BlockSpec each), the
  forward's poison rows when given, and the gate's a_log / dt_bias when the
  kernel activates it (`Prologue`)."""
  hk, hv = q.shape[2], v.shape[2]
  ops = [
      _Operand("q", _flat(q), block=_token_block(st, chunk_of, hk * st.dim_k)),
      _Operand("k", _flat(k), block=_token_block(st, chunk_of, hk * st.dim_k)),
      _Operand("v", _flat(v), block=_token_block(st, chunk_of, hv * st.dim_v)),
      _Operand("log_decay", log_decay, block=_token_block(st, chunk_of, hv)),
      _Operand("beta", beta, block=_token_block(st, chunk_of, hv)),
  ]
  if poison is not None:   # [B, Hv, T]: a chunk's block is its rows (tokens in lanes)
    ops.append(_Operand("poison", poison, block=pl.BlockSpec(
        (None, hv, st.chunk), lambda b, i, *_: (b, 0, chunk_of(i)))))
  if st.has_seg:
    ops.append(_Operand("starts", starts, block=pl.BlockSpec(
        (None, 1, st.chunk), lambda b, i, *_: (b, 0, chunk_of(i)))))
  if st.gate_act:
    ops += [_Operand(name, x, block=pl.BlockSpec((1, hv), lambda b, i, *_: (0, 0)))
            for name, x in zip(("a_log", "dt_bias"), pro.gate_params())]
  return ops


def _state_spec(st: _Static, chunk_of):
  """The BlockSpec of a state-shaped operand: the row's [Hv, K, V] state, or
  with per-segment states the slot of the chunk's segment."""
  if not st.n_states:
    return pl.BlockSpec((None, st.hv, st.dim_k, st.dim_v), lambda b, i, *_: (b, 0, 0, 0))
  nc = st.t_len // st.chunk

  def index(b, i, code_ref):
    return (b, _code_slot(code_ref[b * nc + chunk_of(i)]), 0, 0, 0)

  return pl.BlockSpec((None, None, st.hv, st.dim_k, st.dim_v), index)


def _state_shape(st: _Static, b: int) -> jax.ShapeDtypeStruct:
  lead = (b, st.n_states + 1) if st.n_states else (b,)
  return jax.ShapeDtypeStruct((*lead, st.hv, st.dim_k, st.dim_v), F32)


def _interpret_static(st: _Static) -> _Static:
  """`st` for Pallas interpret mode: unrolled head groups are a TPU
  scheduling choice (`_run_groups`), which in interpret mode only makes
  XLA:CPU compile every group's copy (a test with two head groups: 9.0 ->
  13.3 s); `pallas_mosaic_tpu_test` runs them unrolled once."""
  return dataclasses.replace(st, unroll_groups=False, interpret=True)


def _call(kernel, st: _Static, prefetch: dict[str, jax.Array] | None, *, grid,
          inputs: list[_Operand], outputs: list[_Operand], scratch: list[_Operand],
          vmem_limit_bytes, interpret, name, aliases: dict[str, str] | None = None
          ) -> dict[str, jax.Array]:
  """pallas_call of `kernel` on named operands; returns the outputs by name.

  The kernel gets its refs' names (`_Refs`); the `prefetch` arrays (the
  per-segment chunk codes, "code", or `gdn_fwd_requests`' work items) come
  first, as scalar prefetch into SMEM, readable by the index maps too.
  `aliases`: input name -> the output name that updates it in place.
  """
  params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                vmem_limit_bytes=vmem_limit_bytes)
  if interpret:
    st = _interpret_static(st)
  prefetch = prefetch or {}
  names = tuple(prefetch) + tuple(o.name for o in (*inputs, *outputs, *scratch))
  body = functools.partial(kernel, names=names, st=st)
  in_specs, args = [o.block for o in inputs], [o.array for o in inputs]
  out_specs, out_shape = [o.block for o in outputs], [o.shape for o in outputs]
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(prefetch), grid=grid, in_specs=in_specs, out_specs=out_specs,
      scratch_shapes=[o.shape for o in scratch])
  in_index = {o.name: len(prefetch) + i for i, o in enumerate(inputs)}
  out_index = {o.name: i for i, o in enumerate(outputs)}
  res = pl.pallas_call(body, grid_spec=grid_spec, out_shape=out_shape, compiler_params=params,
                       interpret=interpret, name=name,
                       input_output_aliases={in_index[i]: out_index[o]
                                             for i, o in (aliases or {}).items()}
                       )(*prefetch.values(), *args)
  return dict(zip((o.name for o in outputs), res))


def _prepare(q, k, v, log_decay, beta, *, initial_state, segment_ids, chunk, scale,
             interleave, newton, poison=None, sanitize=False, guard=False,
             pro: Prologue = Prologue()):
  """(inputs, h0, starts, segments, static, number of chunks) of one kernel call.

  Per-segment states: the inputs (and `poison`, if given, last) moved to the
  aligned layout, the states with their zero slot, and the `_Segments`;
  otherwise the inputs as given."""
  xs = (q, k, v, log_decay, beta) + ((poison,) if poison is not None else ())
  if initial_state is None or initial_state.ndim != 5:
    starts = None if segment_ids is None else _starts(segment_ids)
    h0, seg = initial_state, None
  else:
    seg = _Segments.build(segment_ids, initial_state.shape[1], chunk)
    # Pads pass the state through: log-decay 0, from a raw gate of -inf when
    # the kernel activates it (-exp(a_log) softplus(-inf) = 0).
    fills = [0.0] * len(xs)
    fills[3] = -jnp.inf if pro.a_log is not None else 0.0
    xs = tuple(seg.layout.to_aligned(x, fill) for x, fill in zip(xs, fills))
    h0, starts = seg.with_zero_slot(initial_state), seg.starts()
  st = _static(xs[0], xs[2], scale=scale, chunk=chunk, interleave=interleave, newton=newton,
               has_seg=starts is not None, has_h0=h0 is not None,
               n_states=0 if seg is None else seg.n_states, pro=pro)
  if guard and seg is not None:
    raise NotImplementedError("the in-kernel guard does not take per-segment states.")
  st = dataclasses.replace(st, sanitize=sanitize and not guard, guard=guard)
  return xs, h0, starts, seg, st, -(-xs[0].shape[1] // chunk)


def gdn_fwd(q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"],
            v: Float[Array, "B T Hv V"], log_decay: Float[Array, "B T Hv"],
            beta: Float[Array, "B T Hv"], *, scale: float,
            initial_state: segments.State | None = None,
            segment_ids: Int[Array, "B T"] | None = None, chunk=128, interleave=16,
            newton=None, write_out=True, emit_residuals=False, final_state=True,
            interpret=False, vmem_limit_bytes=None, sanitize: bool = False,
            poison: Float[Array, "B T Hv"] | None = None, guard: bool = False,
            pro: Prologue = Prologue()):
  """Chunked GDN forward: on prepared inputs (after `prologue.prologue`), or
  with `pro` on the raw q, k and gate (`log_decay` is then the raw g when
  `pro.a_log` is given), the prologue in the kernel.

  The in-kernel half of the forward's `isolation.SegmentGuard`: with
  `sanitize`, non-finite k and v count as 0 (log-decays, betas and states
  come sanitised); `poison` (0, or NaN at the tokens whose outputs must be
  NaN) makes each poisoned token's output NaN. q is read as given (a
  non-finite query reaches its own output only).

  `guard` (not with per-segment states): the forward's whole
  `isolation.SegmentGuard` in the kernel, on the raw inputs and initial
  state (`_guard_fwd_rows`): the poisoned tokens' outputs and final state
  NaN, without `poison`; the residuals then hold a third array, the
  forward's flags [B, NC, Hv, C] f32 (1 at the tokens a bad input reaches)
  for `gdn_bwd(guard=True)`.

  Returns (out [B, T, Hv, V] in v.dtype or None without `write_out`,
  final_state f32 or None without `final_state`, residuals or None): with
  `emit_residuals`,
  (states [B, NC, Hv, K, V], tmats [B, NC, Hv, C, C]), the state entering
  each chunk and T' of each chunk, bf16 for bf16 inputs, else f32.

  `final_state=False`: the kernel has no final-state output at all (an
  output block the last chunk writes back is an HBM write nothing hides:
  v6e, Qwen3-Next heads, T=512, gdn_fwd 53.3 -> 49.6 k cycles without it).

  `initial_state` [B, Hv, K, V] gives final_state [B, Hv, K, V];
  per-segment states [B, N, Hv, K, V] (with `segment_ids`) give each
  segment's end state [B, N, Hv, K, V], and the kernel then runs on the
  chunk-aligned layout (`_Segments`): NC counts its chunks.
  """
  xs, h0, starts, seg, st, nc = _prepare(
      q, k, v, log_decay, beta, initial_state=initial_state, segment_ids=segment_ids,
      chunk=chunk, scale=scale, interleave=interleave, newton=newton, poison=poison,
      sanitize=sanitize, guard=guard, pro=pro)
  q, k, v, log_decay, beta = xs[:5]
  b, t = q.shape[:2]
  poison_rows = (jnp.swapaxes(xs[5], 1, 2).astype(F32)
                 if poison is not None and write_out else None)
  inputs = _common_inputs(q, k, v, log_decay, beta, starts, st, lambda i: i,
                          poison=poison_rows, pro=pro)
  out_block = _token_block(st, lambda i: i, st.hv * st.dim_v)
  out_shape = jax.ShapeDtypeStruct((b, t, st.hv * st.dim_v), v.dtype)
  return _run_fwd(inputs, h0, st, seg, nc, b, out_block if write_out else None, out_shape,
                  emit_residuals=emit_residuals, final_state=final_state, interpret=interpret,
                  vmem_limit_bytes=vmem_limit_bytes)


@dataclasses.dataclass(frozen=True)
class PackedRequests:
  """Up to N requests on one packed token row for `gdn_fwd_requests`.

  Lane n holds request [start_n, start_n + length_n) (length 0: an unused
  lane), starting from the state pool's slot read_n where init_n (else from
  zeros), its final state written to slot write_n. Used lanes are in token
  order; no lane reads a slot another one writes.
  """

  start: jax.Array    # [N] int32
  length: jax.Array   # [N] int32
  init: jax.Array     # [N] bool
  read: jax.Array     # [N] int32
  write: jax.Array    # [N] int32


def num_items(t_len: int, lanes: int, chunk: int) -> int:
  """Work items of `lanes` requests on T tokens: the blocks each spans, at
  most ceil(T / C) + lanes - 1 (two disjoint requests share a block at most
  at their boundary)."""
  return -(-t_len // chunk) + lanes - 1


def _item_table(req: PackedRequests, t_len: int, chunk: int):
  """Per work item j (a C-token block of the row and one request touching it,
  in token order): (block, read slot, write slot, flags = run | enter << 1 |
  leave << 2 | init << 3 | lo << 4 | hi << 12 | fresh << 20: the request's
  rows [lo, hi) of the block; fresh: the block's first item), int32 [J] each.

  Items past the last one repeat its block, lane and slot with run = 0: their
  index maps fetch nothing new and the kernel skips them.
  """
  n = req.start.shape[0]
  big = num_items(t_len, n, chunk)
  used = req.length > 0
  first = req.start // chunk
  count = jnp.where(used, (req.start + req.length - 1) // chunk - first + 1, 0)
  ends = jnp.cumsum(count)
  total = ends[-1]
  j = jnp.arange(big, dtype=jnp.int32)
  jj = jnp.minimum(j, jnp.maximum(total - 1, 0))
  lane = jnp.minimum(jnp.sum((ends[None, :] <= jj[:, None]).astype(jnp.int32), axis=1), n - 1)
  i = jj - (ends - count)[lane]
  block = jnp.clip(first[lane] + i, 0, -(-t_len // chunk) - 1)
  lo = jnp.clip(req.start[lane] - block * chunk, 0, chunk)
  hi = jnp.clip(req.start[lane] + req.length[lane] - block * chunk, 0, chunk)
  fresh = jnp.concatenate([jnp.ones((1,), bool), block[1:] != block[:-1]])
  flags = ((j < total).astype(jnp.int32) | (i == 0).astype(jnp.int32) << 1
           | (i == count[lane] - 1).astype(jnp.int32) << 2
           | req.init[lane].astype(jnp.int32) << 3 | lo << 4 | hi << 12
           | fresh.astype(jnp.int32) << 20)
  return block.astype(jnp.int32), req.read[lane], req.write[lane], flags


def gdn_fwd_requests(qkv: Float[Array, "T D"], log_decay: Float[Array, "T Hv"],
                     beta: Float[Array, "T Hv"], state_pool: Float[Array, "S Hv K V"],
                     requests: PackedRequests, out_base: Float[Array, "T HvV"], *, hk: int,
                     hv: int, dim_k: int, dim_v: int, scale: float, chunk=128, interleave=16,
                     newton=None, all_run: bool = False, static_blocks: bool = False,
                     in_hbm: bool = False, interpret=False, vmem_limit_bytes=None):
  """The chunked GDN forward over the requests of one packed token row (the
  serving op's chunked path).

  q, k, v are lane ranges of qkv [T, 2 Hk K + Hv V] (K, V multiples of 128:
  heads are aligned lane slices of a block, no relayout); q and k are
  L2-normalised in the kernel (`prologue.l2norm`, float32), k and v read as
  0 where beta is 0 (`_packed_heads`). The grid is a list of work items
  (`_item_table`, scalar-prefetched): one per C-token block and request
  touching it, in token order, at most ceil(T / C) + N - 1. An item runs
  its request's rows [lo, hi) of the block; the block's other tokens count
  as beta 0 and log-decay 0 (they pass the state through; a NaN there is
  selected away) and their output rows are left as they are: the output
  block stays resident across the items of one block, its first item loads
  it from `out_base` (aliased: the output updates it in place). A request's
  first item DMAs its initial state from its read slot of `state_pool` (any
  float dtype; zeros where not `init`), its last DMAs the final state into
  its write slot (aliased, in place). Blocks stay aligned: Mosaic's pipeline
  takes no element offset it cannot prove tile-aligned.

  Items past the requests' blocks (all of them in a decode batch) do nothing
  and move nothing: their index maps repeat the last block and the body is
  under `pl.when` of the run flag. How libtpu's static estimate counts that
  (measured on v6e, a 16-step kernel of four dependent 256x1024x1024 bf16
  matmuls per step, blocks of 256 rows in and out): 76.6 k cycles; the body
  under a pl.when on a scalar-prefetched flag 17.4 k (a skipped body costs
  nothing, the block DMAs still count); block indices from SMEM that stay
  the same 14.1 k (inputs) and 7.1 k (inputs and output): a DMA of a
  data-dependent, repeated block index counts as nothing either. So a call
  whose requests run no block costs its empty steps.

  The estimator aborts on this kernel as it runs ("No DMA issue node found
  for sync flag", v6e and tpu7x), whenever its blocks' indices come from
  SMEM (with the state blocks pipelined too, and the final-state write and
  initial-state read both under branches on SMEM flags); the same kernel at
  static block indices is estimated. `static_blocks` compiles it so, item j
  on block min(j, ceil(T/C) - 1), for estimates only (results meaningless):
  every item then moves its blocks, at least the real kernel's traffic.
  `all_run` (with `static_blocks`) compiles one item per block, each
  running: the cost model of a call whose chunked requests cover the
  blocks, one item each (a prefill, or tp8_mixed_64_t8192's prefill after
  63 decodes: the real kernel runs 64 of its ceil(T/C) + N - 1 = 127 items
  and skips the rest; running all 127 had counted every skipped item as a
  whole block, v6e 848 k cycles for this kernel vs 429 k for the same
  prefill alone). Without it the static-block estimate is that of a call
  whose items are all skipped.

  `in_hbm`: qkv and out_base (so out) stay in HBM (else XLA may place them
  in VMEM; see the serving op's `_HBM_TOKEN_BYTES`). Keeping log_decay and
  beta there too made libtpu's estimator abort on the static-block kernel
  (v6e, 4096 tokens: "No DMA issue node found for sync flag").

  Returns (out [T, Hv V] in qkv's dtype, state_pool): `out_base` with the
  requests' output rows written, and the pool with their final states.
  """
  t, width = qkv.shape
  if width != 2 * hk * dim_k + hv * dim_v:
    raise ValueError(f"qkv {qkv.shape}: expected 2 hk dim_k + hv dim_v ="
                     f" {2 * hk * dim_k + hv * dim_v} lanes.")
  if chunk > 255:
    raise ValueError(f"gdn_fwd_requests: chunk {chunk} > 255 (8-bit row bounds per item).")
  n = requests.start.shape[0]
  items, blocks = num_items(t, n, chunk), -(-t // chunk)
  passes = 1 if qkv.dtype == BF16 else 3
  st = _Static(t_len=t, chunk=chunk, hk=hk, hv=hv, dim_k=dim_k, dim_v=dim_v,
               scale=float(scale), passes=passes,
               newton=default_newton(passes) if newton is None else newton,
               interleave=normalize_interleave(interleave, hv, hv // hk), has_seg=False,
               has_h0=True, packed=True, qk_l2norm=True, beta_guard=True, requests=True,
               gated=not all_run, v5e_forms=_v5e_forms(), unroll_groups=_unroll_groups())
  block, read, write, flags = _item_table(requests, t, chunk)
  if all_run:
    flags = flags | 1
  if static_blocks:
    pick = lambda j, _: jnp.minimum(j, blocks - 1)
  else:
    pick = lambda j, ref: ref[j]
  # Index maps take (0, j, block, read, write, flags).
  rows = lambda width: pl.BlockSpec((chunk, width), lambda b, j, *refs: (pick(j, refs[0]), 0))
  state = pl.BlockSpec(memory_space=pl.ANY)    # moved by the kernel's DMAs
  out_base = out_base.astype(qkv.dtype)
  if in_hbm:
    qkv, out_base = (pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in (qkv, out_base))
  inputs = [_Operand("qkv", qkv, block=rows(width)),
            _Operand("log_decay", log_decay, block=rows(hv)),
            _Operand("beta", beta, block=rows(hv)),
            _Operand("h0", state_pool, block=state),
            _Operand("base", out_base, block=rows(hv * dim_v))]
  outputs = [_Operand("out", block=rows(hv * dim_v),
                      shape=jax.ShapeDtypeStruct((t, hv * dim_v), qkv.dtype)),
             _Operand("pool", block=state,
                      shape=jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype))]
  scratch = ([_Operand("s", shape=pltpu.VMEM((hv, dim_k, dim_v), F32))]
             + _head_scratch(st, ("vh", "out_heads"))
             + [_Operand("h0_buf", shape=pltpu.VMEM((hv, dim_k, dim_v), state_pool.dtype)),
                _Operand("sem", shape=pltpu.SemaphoreType.DMA((2,)))])
  res = _call(functools.partial(_fwd_kernel, write_out=True, emit=False), st,
              dict(item_block=block, item_slot=read, item_write=write, item_flags=flags),
              grid=(1, blocks if all_run and static_blocks else items), inputs=inputs,
              outputs=outputs, scratch=scratch,
              vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, name="gdn_fwd_requests",
              aliases=dict(base="out", h0="pool"))
  return res["out"], res["pool"]


def _run_fwd(inputs: list[_Operand], h0, st: _Static, seg: "_Segments | None", nc: int, b: int,
             out_block, out_shape, *, emit_residuals: bool, final_state: bool, interpret,
             vmem_limit_bytes):
  """The forward kernel's call on prepared inputs: adds the initial state, the
  outputs (`out` when `out_block` is given, the final state with
  `final_state`, the residuals)
  and the scratch; returns (out, final_state, residuals) as `gdn_fwd`."""
  write_out = out_block is not None
  chunk = st.chunk
  state_spec = _state_spec(st, lambda i: i)
  if st.has_h0:
    inputs.append(_Operand("h0", h0.astype(F32), block=state_spec))
  outputs = []
  if write_out:
    outputs.append(_Operand("out", block=out_block, shape=out_shape))
  if final_state:
    outputs.append(_Operand("final", block=state_spec, shape=_state_shape(st, b)))
  if emit_residuals:
    outputs += [
        _Operand("states", block=pl.BlockSpec((None, None, st.hv, st.dim_k, st.dim_v),
                                              lambda b, i, *_: (b, i, 0, 0, 0)),
                 shape=jax.ShapeDtypeStruct((b, nc, st.hv, st.dim_k, st.dim_v), st.mm)),
        _Operand("tmats", block=pl.BlockSpec((None, None, st.hv, chunk, chunk),
                                             lambda b, i, *_: (b, i, 0, 0, 0)),
                 shape=jax.ShapeDtypeStruct((b, nc, st.hv, chunk, chunk), st.mm))]
    if st.guard:
      outputs.append(_guard_fwd_operand(st, b, nc, lambda i: i))
  scratch = ([_Operand("s", shape=pltpu.VMEM((st.hv, st.dim_k, st.dim_v), F32))]
             + _head_scratch(st, ("vh", "out_heads") if write_out else ("vh",))
             + _guard_scratch(st, 1))
  res = _call(
      functools.partial(_fwd_kernel, write_out=write_out, emit=emit_residuals), st,
      None if seg is None else dict(code=seg.code),
      grid=(b, nc), inputs=inputs, outputs=outputs, scratch=scratch,
      vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
      name="gdn_fwd" if write_out else "gdn_fwd_states")
  out, final = res.get("out"), res.get("final")
  if out is not None:
    out = out.reshape(*out.shape[:2], st.hv, st.dim_v)
  if seg is not None:
    out = None if out is None else seg.layout.from_aligned(out)
    final = None if final is None else seg.per_segment(final)
  residuals = (res["states"], res["tmats"]) if emit_residuals else None
  if emit_residuals and st.guard:
    residuals += (res["guard_fwd"],)
  return out, final, residuals


def _guard_fwd_operand(st: _Static, b: int, nc: int, chunk_of, array=None) -> _Operand:
  """The forward's guard flags [B, NC, Hv, C] f32 (`_guard_fwd_rows`): an
  output of the forward kernels, an input (`array`) of the backward."""
  block = pl.BlockSpec((None, None, st.hv, st.chunk), lambda b, i, *_: (b, chunk_of(i), 0, 0))
  if array is not None:
    return _Operand("guard_fwd", array, block=block)
  return _Operand("guard_fwd", block=block,
                  shape=jax.ShapeDtypeStruct((b, nc, st.hv, st.chunk), F32))


def _guard_scratch(st: _Static, n_rows: int) -> list[_Operand]:
  """The guard's scratch (`_Static.guard`): `n_rows` (Hv, C) flag rows and
  the flag carried along the chunks (Hv, 128); none without the guard."""
  if not st.guard:
    return []
  rows = (n_rows, st.hv, st.chunk) if n_rows > 1 else (st.hv, st.chunk)
  return [_Operand("guard_rows", shape=pltpu.VMEM(rows, F32)),
          _Operand("guard_carry", shape=pltpu.VMEM((st.hv, 128), F32))]


def gdn_bwd(q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"],
            v: Float[Array, "B T Hv V"], log_decay: Float[Array, "B T Hv"],
            beta: Float[Array, "B T Hv"], d_out: Float[Array, "B T Hv V"],
            d_final: segments.State | None, *, scale: float,
            initial_state: segments.State | None = None,
            segment_ids: Int[Array, "B T"] | None = None, residuals=None, chunk=128,
            interleave=16, newton=None, interpret=False, vmem_limit_bytes=None,
            sanitize=False, guard=False, pro: Prologue = Prologue()):
  """Chunked GDN backward: (dq, dk, dv, d_log_decay, dbeta, d_initial_state f32
  or None without `initial_state`: the kernel then has no such output).

  The gradients of the inputs come in their dtypes. With `pro` (the raw q, k
  and gate in, as `gdn_fwd`'s) they are those of the raw inputs (dq, dk
  through the L2 norm, d_log_decay that of the raw g), and with `pro.a_log`
  there are two more, [B, 1, Hv] f32 each: each batch row's part of
  a_log's gradient and of dt_bias's (the sum of d_log_decay's in float32);
  the gradients are their sums over B.

  `sanitize`: non-finite q, k, v and d_out count as 0 (the in-kernel half of
  the backward's `isolation.SegmentGuard`; the rest comes sanitised).
  `guard` (not with per-segment states): the whole of it in the kernels, on
  the raw inputs, states and cotangents (`_guard_bwd_rows`): every gradient
  of the poisoned tokens NaN, and a_log's parts of the heads with one.

  `residuals`: `gdn_fwd(emit_residuals=True)`'s (same `initial_state`,
  `segment_ids` and chunk), or None to recompute them (pass 1: the forward
  kernel without outputs). d_final and d_initial_state have the final
  state's shape ([B, N, Hv, K, V] for per-segment states).
  """
  if residuals is None:
    _, _, residuals = gdn_fwd(
        q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk=chunk, interleave=interleave, newton=newton,
        write_out=False, emit_residuals=True, final_state=False, interpret=interpret,
        vmem_limit_bytes=vmem_limit_bytes, sanitize=sanitize, guard=guard, pro=pro)
  t_in = q.shape[1]
  (q, k, v, log_decay, beta), h0, starts, seg, st, nc = _prepare(
      q, k, v, log_decay, beta, initial_state=initial_state, segment_ids=segment_ids,
      chunk=chunk, scale=scale, interleave=interleave, newton=newton, sanitize=sanitize,
      guard=guard, pro=pro)
  b, t = q.shape[:2]
  st = dataclasses.replace(st, unroll_groups=_unroll_groups(backward=True))
  states, tmats = residuals[:2]
  if states.shape[1] != nc:
    raise ValueError(f"residuals for {states.shape[1]} chunks; this call has {nc}.")
  rev = lambda i: nc - 1 - i
  inputs = _common_inputs(q, k, v, log_decay, beta, starts, st, rev, pro=pro)
  state_spec = _state_spec(st, rev)
  if d_final is None and not st.guard:   # (the guard's kernel reads none as zeros)
    d_final = jnp.zeros(_state_shape(st, b).shape, F32)
  elif seg is not None:
    d_final = seg.with_zero_slot(d_final)
  if seg is not None:
    d_out = seg.layout.to_aligned(d_out)
  inputs += [
      _Operand("states", states, block=pl.BlockSpec((None, None, st.hv, st.dim_k, st.dim_v),
                                                    lambda b, i, *_: (b, rev(i), 0, 0, 0))),
      _Operand("tmats", tmats, block=pl.BlockSpec((None, None, st.hv, chunk, chunk),
                                                  lambda b, i, *_: (b, rev(i), 0, 0, 0))),
      _Operand("d_out", _flat(d_out), block=_token_block(st, rev, st.hv * st.dim_v)),
  ]
  if d_final is not None:
    inputs.append(_Operand("d_final", d_final.astype(F32), block=state_spec))
  if st.guard:
    inputs.append(_guard_fwd_operand(st, b, nc, rev, residuals[2]))
  hk = q.shape[2]
  grad_names = ("dq", "dk", "dv", "d_gate", "dbeta", "d_h0") + (
      ("d_a_log", "d_dt_bias") if st.gate_act else ())
  flat_shape = lambda x: jax.ShapeDtypeStruct(_flat(x).shape, x.dtype)
  outputs = [
      _Operand("dq", block=_token_block(st, rev, hk * st.dim_k), shape=flat_shape(q)),
      _Operand("dk", block=_token_block(st, rev, hk * st.dim_k), shape=flat_shape(k)),
      _Operand("dv", block=_token_block(st, rev, st.hv * st.dim_v), shape=flat_shape(v)),
      _Operand("d_gate", block=_token_block(st, rev, st.hv),
               shape=jax.ShapeDtypeStruct((b, t, st.hv), log_decay.dtype)),
      _Operand("dbeta", block=_token_block(st, rev, st.hv),
               shape=jax.ShapeDtypeStruct((b, t, st.hv), beta.dtype)),
  ]
  if initial_state is not None:
    outputs.append(_Operand("d_h0", block=state_spec, shape=_state_shape(st, b)))
  if st.gate_act:
    # Resident over the chunks: the kernel accumulates into them.
    outputs += [_Operand(name, block=pl.BlockSpec((None, 1, st.hv), lambda b, i, *_: (b, 0, 0)),
                         shape=jax.ShapeDtypeStruct((b, 1, st.hv), F32))
                for name in ("d_a_log", "d_dt_bias")]
  scratch = ([_Operand("ds", shape=pltpu.VMEM((st.hv, st.dim_k, st.dim_v), F32))]
             + _head_scratch(st, ("vh", "doh"))
             + [_Operand("dq_heads", shape=pltpu.VMEM((st.hk, chunk, st.dim_k), F32)),
                _Operand("dk_heads", shape=pltpu.VMEM((st.hk, chunk, st.dim_k), F32)),
                _Operand("dv_heads", shape=pltpu.VMEM((st.hv, chunk, st.dim_v), F32)),
                _Operand("dg_rows", shape=pltpu.VMEM((st.hv, chunk), F32)),
                _Operand("db_rows", shape=pltpu.VMEM((st.hv, chunk), F32))]
             + _guard_scratch(st, 2))
  res = _call(
      _bwd_kernel, st, None if seg is None else dict(code=seg.code), grid=(b, nc),
      inputs=inputs, outputs=outputs, scratch=scratch, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, name="gdn_bwd")
  for n, x in (("dq", q), ("dk", k), ("dv", v)):
    res[n] = res[n].reshape(x.shape)
  grads = tuple(res.get(n) for n in grad_names)
  if seg is None:
    return grads
  per_token = [seg.layout.from_aligned(res[n]) for n in grad_names[:5]]
  assert per_token[0].shape[1] == t_in
  d_h0 = None if initial_state is None else seg.per_segment(res["d_h0"])
  return (*per_token, d_h0) + grads[6:]
