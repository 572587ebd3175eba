"""Float arithmetic shared by the kernels (XLA and Pallas alike).

`two_sum` is the compensated addition of the in-chunk cumsums. The rest is
TPU precision: bf16 MXU products with f32 accumulation (`mm`, `mxu`), f32
values split into bf16 pieces (`split`, `split_bf16`, `stacked_bf16`,
`rounded_bf16`, `round_bf16`), and `lhs_masked`. `v5e_forms` arguments select
forms libtpu's v5e cycle estimator accepts (same values up to ties in rounding
to bf16; `docs/gdn_pallas_tpu.md`, "v5e forms").
"""

import functools
import operator

from jax import lax
import jax.numpy as jnp

F32, BF16 = jnp.float32, jnp.bfloat16


def two_sum(a, b):
  """(s, e) with s = fl(a + b) and a + b = s + e exactly (Knuth's TwoSum).

  Plain array arithmetic, so it runs inside Pallas kernels as well as in XLA;
  the compensated in-chunk cumsums of both GDN kernels are built on it
  (docs/gdn_math.md, "The compensated cumsum").
  """
  s = a + b
  b_virtual = s - a
  e = (a - (s - b_virtual)) + (b - b_virtual)
  return s, e


def mm(a, b, *, ta=False, tb=False):
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


def split(x, n, v5e_forms=False):
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
  pieces = split(x, n, v5e_forms)
  rest = pieces[-1][1]
  last = round_bf16(rest) if v5e_forms else (rest.astype(BF16), rest.astype(BF16).astype(F32))
  pieces = pieces[:-1] + [last]
  return ([piece for piece, _ in pieces],
          functools.reduce(operator.add, [wide for _, wide in pieces]))   # largest first


def split_bf16(x, n, v5e_forms=False):
  """x (f32) as n bf16 pieces whose sum is x (exactly for n = 3)."""
  return [piece for piece, _ in split(x, n, v5e_forms)]


def stacked_bf16(x, n, v5e_forms=False):
  """(`split_bf16(x, n)` stacked along rows, (n·rows, cols) bf16; its first piece).

  v5e forms: stacked in f32 and cast once (no bf16 concatenation).
  """
  pieces = split(x, n, v5e_forms)
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
  transpose_lhs), cheaper than transposing it first on the XLU (`bwd_kernel.bwd_kernel`).

  1: both operands rounded to bf16. 3: each f32 operand split hi + lo and
  hi·hi + hi·lo + lo·hi summed (an exact bf16 operand is not split).
  `v5e_forms`: the split by `round_bf16` (module docstring).
  """
  if passes == 1:
    return mm(a.astype(BF16), b.astype(BF16), ta=ta, tb=tb)
  ah, al = (a, None) if a.dtype == BF16 else split_bf16(a, 2, v5e_forms)
  bh, bl = (b, None) if b.dtype == BF16 else split_bf16(b, 2, v5e_forms)
  out = mm(ah, bh, ta=ta, tb=tb)
  if bl is not None:
    out = out + mm(ah, bl, ta=ta, tb=tb)
  if al is not None:
    out = out + mm(al, bh, ta=ta, tb=tb)
  return out
