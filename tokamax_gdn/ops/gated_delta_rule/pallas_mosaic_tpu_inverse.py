"""The triangular inverse of the Pallas GDN kernels: T' = (I + A')⁻¹.

`invert_unit_lower` inverts a list of strictly lower-triangular C×C matrices
level by level (2×2 diagonal blocks, then block merges, then optional Newton
steps), two matrices per MXU tile. Algebra: `docs/gdn_math.md` ("The inverse");
precision and pairing: `docs/gdn_pallas_tpu.md`.
"""

import math

from jax import lax
import jax.numpy as jnp

from tokamax_gdn.ops import numerics

F32, BF16 = jnp.float32, jnp.bfloat16


def _folded_rows(size: int, c: int) -> int:
  """Rows of the folded tiles of the merge of size-blocks into 2·size ones:
  2·size, at least 16 (a bf16 vreg's rows), at most C (not folded)."""
  return min(c, max(16, 2 * size))


def _block_of(x, size: int):
  return lax.shift_right_logical(x, jnp.int32(int(math.log2(size))))


def _coords(r: int, c: int):
  """(full row, column) of each element of a tile folded to r rows."""
  i = lax.broadcasted_iota(jnp.int32, (r, c), 0)
  j = lax.broadcasted_iota(jnp.int32, (r, c), 1)
  return _block_of(j, r) * r + i, j


def _merge_masks(i, j, size: int):
  """At full coordinates (i, j), the masks of the merge of size-blocks into
  2·size ones (`invert_unit_lower`): the off blocks of the pair's a's, and
  the parts of z the products take left and right of them."""
  rb, cb = _block_of(i, size), _block_of(j, size)
  first = (rb & jnp.int32(1)) == 0
  off = (_block_of(i, 2 * size) == _block_of(j, 2 * size)) & (rb != cb)
  lower, upper = i >= j, i <= j
  left = (first & upper) | (jnp.logical_not(first) & lower)
  right = (first & lower) | (jnp.logical_not(first) & upper)
  return off, left, right


def _fold(x, r: int):
  """A (C, C) tile whose r×r diagonal blocks are side by side in r rows:
  [i, j] = x[r·(j // r) + i, j] (selects of its row blocks; lanes stay)."""
  c = x.shape[0]
  if r == c:
    return x
  blk = _block_of(lax.broadcasted_iota(jnp.int32, (r, c), 1), r)
  out = x[:r]
  for b in range(1, c // r):
    out = jnp.where(blk == b, x[b * r:(b + 1) * r], out)
  return out


def _refold(x, r: int, rows: int):
  """`_fold` to r rows of a block-diagonal tile (r×r blocks) refolded to
  `rows` (a multiple of r): the row blocks of the wider fold are x where
  its lane block sits at that row block, else 0."""
  c = x.shape[1]
  blk = _block_of(lax.broadcasted_iota(jnp.int32, (r, c), 1), r) & jnp.int32(rows // r - 1)
  return jnp.concatenate([jnp.where(blk == j, x, 0.0) for j in range(rows // r)], 0)


def _tiled(x, c: int):
  """A tile folded to r rows stacked to (C, C): right operands take it
  masked to the r×r diagonal blocks."""
  r = x.shape[0]
  return x if r == c else jnp.concatenate([x] * (c // r), 0)


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
  T_iᵀ, for products that take it transposed (`numerics.mxu(ta=True)`, the MXU's to
  do) and stores that transpose it once. `v5e_forms`: see the module
  docstring.

  Accuracy. T0 against the float64 inverse, near-duplicate keys, no decay,
  β ≈ 1 (the hardest case of the inverse test), C = 64 / 128 / 256:
  2.5e-3 / 2.9e-3 / 3.7e-3, and 2.5e-3 / 2.8e-3 / 3.6e-3 after one Newton
  step with a in bf16 (that step's floor): bf16 inputs take no step
  (`common.default_newton`). (The Neumann sums on 8×8 blocks this start replaced
  left 1.8e-2 / 1.7e-2 / 1.8e-2, which that step was for.)

  Cost. In v6e's estimate a product's MXU time follows the rows of its right
  operand (weights: a 128×128 bf16 one is 8 pushes of 4 cycles on one of the
  two MXUs, whatever the left operand's rows), and one MXU's pushes are most
  of `call.gdn_fwd`'s critical path. The pairs halve the merges' pushes, but with
  16 heads interleaved a level then has 8 pairs, too few to hide its latency:
  the unrolled kernels invert every head group's matrices in one list
  (`fwd_kernel._fwd_chunk`; tpu7x, whose head groups run in a loop, pairs
  per group). Each step (pairs, one list, no Newton step for bf16) made the
  forward kernels cheaper on the v6e, v5e and tpu7x estimates. On v5e
  (4 MXUs of 128×128) the left operand's rows count too: 16 cycles per bf16
  vreg of 16 rows, after 8 pushes of the right operand 4 cycles apart, and
  the forward kernels are bound by the MXUs' streamed rows, half of them
  the merges'. Level s (2s-blocks) is block-diagonal with r×r blocks for
  r ≥ 2s, so its left operands are folded to r = max(16, 2s) rows
  (`_fold`): 16 rows for the 2-, 4-, 8- and 16-blocks, 32 and 64 for the
  next, C only for the last level (same products, bit-identical T): the
  Qwen3-Next forward kernel 0.643 -> 0.534 M estimated cycles on v5e at
  T = 4096, and slightly cheaper on v6e and tpu7x too.
  """
  c = a_list[0].shape[0]
  row = lax.broadcasted_iota(jnp.int32, (c, c), 0)
  col = lax.broadcasted_iota(jnp.int32, (c, c), 1)
  lower, upper = row >= col, row <= col
  # Pairs: a_{2i} and a_{2i+1}ᵀ in one tile (strictly lower / strictly
  # upper), their inverses T_{2i} and T_{2i+1}ᵀ in one tile z (unit diagonal
  # shared); a last unpaired matrix alone. The tile of the a's is only ever
  # a bf16 operand: transposed in bf16, half the vregs through the XLU; not
  # in the v5e forms (16-bit packing).
  pairs = [(a_list[i], a_list[i + 1] if i + 1 < len(a_list) else None)
           for i in range(0, len(a_list), 2)]
  wide = F32 if v5e_forms else BF16
  combs = [a.astype(wide) if an is None else a.astype(wide) + an.astype(wide).T
           for a, an in pairs]
  base = min(2, c)
  # Merges size → 2·size, T ← T − T a_off T, both matrices of a pair in one
  # product each: the lower one's off block (second half's rows, first half's
  # columns of each 2·size window) and the upper one's (the mirror) are
  # disjoint, and so are the rows of z each needs on the right (the lower
  # one's T in the first halves, the upper one's in the second) and on the
  # left (the other way round).
  #
  # Folded tiles: while the merged blocks have at most r rows (r =
  # `_folded_rows(size, c)`), every tile of a level is block-diagonal with
  # r×r blocks, and the left operands and z are kept folded to r rows
  # (`_fold`: the diagonal blocks side by side, lanes where they are, so
  # folding and unfolding are selects). A folded left operand against the
  # full right one is the folded product, with r rows instead of C through
  # the MXU (see "Cost" above).
  r = _folded_rows(base, c)
  combs_r = {}

  def comb_at(k, rows):
    if (k, rows) not in combs_r:
      combs_r[k, rows] = _fold(combs[k], rows)
    return combs_r[k, rows]

  fr, fc = _coords(r, c)
  same = _block_of(fr, base) == _block_of(fc, base)
  eye = (fr == fc).astype(F32)
  zs = [eye - jnp.where(same, comb_at(k, r), 0.0).astype(F32)            # 2×2 blocks: I − a
        for k in range(len(combs))]
  size = base
  while size < c:
    rows = _folded_rows(size, c)
    if rows != r:
      zs = [_refold(z, r, rows) for z in zs]
      r = rows
    off, left, _ = _merge_masks(*_coords(r, c), size)     # on the folded tiles
    in_block = _block_of(row, r) == _block_of(col, r)
    right = in_block & _merge_masks(row, col, size)[2]    # on the full right operands
    prods = [numerics.mm(numerics.lhs_masked(off, comb_at(k, r), v5e_forms).astype(BF16),
                         jnp.where(right, _tiled(z, c), 0.0).astype(BF16))
             for k, z in enumerate(zs)]
    zs = [z - numerics.mm(numerics.lhs_masked(left, z, v5e_forms).astype(BF16),
                          jnp.where(in_block, _tiled(pr, c), 0.0).astype(BF16))
          for z, pr in zip(zs, prods)]
    size *= 2
  # (a, T0, strict mask, transposed): an upper one's T0 is T_iᵀ, the inverse
  # of I + a_iᵀ, refined as it is (the same steps, with a_iᵀ).
  heads = []
  for (a, an), z in zip(pairs, zs):
    heads.append((a, z if an is None else jnp.where(lower, z, 0.0), row > col, False))
    if an is not None:
      heads.append((an.T if newton else None, jnp.where(upper, z, 0.0), row < col, True))
  ts = [numerics.round_bf16(inv) if v5e_forms else (inv.astype(BF16), None)
        for _, inv, _, _ in heads]                         # (bf16 T, f32 T or None)
  for _ in range(newton):
    staged = []
    for t, (a, _, strict, _) in zip(ts, heads):
      if isinstance(t, tuple):
        t_parts, tf = [t[0]], t[0].astype(F32) if t[1] is None else t[1]
      else:
        t_parts, tf = numerics.split_bf16(t, 2, v5e_forms), t
      if newton == 1:
        # One step (bf16 inputs): its residual takes a in bf16 only (one
        # 128-row product, no hi/lo split), so it converges to
        # (I + bf16(a))⁻¹, a within 2⁻⁹ per entry, the perturbation rounding
        # T to bf16 for the products that use it makes anyway. Near-duplicate
        # keys (the inverse test): error within the bf16 contract, for a
        # cheaper forward. (float32's first of two
        # steps too cost its outputs ~25 % more error on unnormalised keys.)
        a_hi = numerics.round_bf16(a)[0] if v5e_forms else a.astype(BF16)
        at = numerics.mm(a_hi, t_parts[0])
      else:
        stacked, a_hi = numerics.stacked_bf16(a, 2, v5e_forms)      # [a_hi; a_lo]: one weight push of T
        at2 = numerics.mm(stacked, t_parts[0])
        if len(t_parts) == 1:
          at = at2[:c] + at2[c:]
        else:
          at = at2[:c] + (at2[c:] + numerics.mm(a_hi, t_parts[1]))
      staged.append((t_parts, tf, at, strict))
    ts = []
    for t_parts, tf, at, strict in staged:
      # −(I − (I + a) T), nonzero strictly below the diagonal only (there
      # I's entries are 0), and T − T (that): one negation and one
      # subtraction of I fewer than forming I − (I + a) T (the same values).
      r = jnp.where(strict, tf + at, 0.0).astype(BF16)
      corr = numerics.mm(t_parts[0], r)
      for p in t_parts[1:]:
        corr = corr + numerics.mm(p, r)
      ts.append(tf - corr)
  return [((t[0].astype(F32) if t[1] is None else t[1]) if isinstance(t, tuple) else t,
           transposed) for t, (_, _, _, transposed) in zip(ts, heads)]
