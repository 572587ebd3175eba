"""Chunked gated delta rule in pure JAX: the stages of docs/gdn_math.md and their scans.

The notation, the forward and the backward equations are in `docs/gdn_math.md`;
every quantity has the name it has there (`gcum`, `gamma`,
`decay_in`, `decay_out`, `decay_chunk`, `a`, `tmat`, `k_beta`, `v_beta`, `w`,
`u`, `v_new`, `p`, `k_out`, `out`, `s_next`; gradients `d_<name>`), and the
stage functions are docs/gdn_math.md's:

  chunk_gate        -> gcum, gamma, decay_in, decay_out, decay_chunk, masks
  invert_unit_lower -> tmat
  chunk_wy          -> a, tmat, k_beta, v_beta, w, u, p, k_out  (state-free)
  chunk_state_fwd   -> v_new, out, s_next                       (one chunk)
  chunk_state_bwd   -> d_v_new, ds_prev, the state terms of dq, dk, d_gcum
  chunk_wy_bwd      -> the state-free terms of dq, dk, dv, dbeta, d_gcum
  chunk_gate_bwd    -> dg from d_gcum

Stages work on whole blocks at once, batched over chunks and heads:
key-side arrays are [N, B, Hk, C, K], value-side [N, B, Hk, G, C, V] with G =
Hv / Hk value heads per key head (GVA: k-side products are computed once per
key head and broadcast), per-token gate-side [N, B, Hk, G, C]; the state
stages take one chunk (no N axis) inside a `lax.scan` over chunks.

Two levels of scan keep the cost linear in T. The sequence is cut into blocks
of L tokens (a multiple of C; one block when T <= L); an outer float32
`lax.scan` over blocks carries the state S. Within a block the state-free
stages run batched over the block's L / C chunks and an inner scan over
chunks carries S. Temporaries are O(L C) per head rather than O(T C), and
stay in cache on CPU. T is padded internally to a multiple of L (beta = 0,
g = 0, k = 0 on the tail: the state passes through unchanged). A segment
start at a block's first token is an ordinary in-chunk start (decay_in =
decay_chunk = 0), so nothing leaks across it either way.

The backward is an outer reverse scan over blocks carrying dS, each block
started from its saved entry state; within a block the chunk-entry states
are recomputed by a forward scan, then a reverse scan over chunks runs
`chunk_state_bwd`, and the state-free gradients follow batched over chunks.

Saved vs recomputed: the op's own residuals are the float32 states entering
each block, [B, Hv, T / L, K, V] (None for a single block): K V 4 / L bytes
per token per value head, 32 B at K = V = 128 and L = 2048 (128 B at
L = 512). tokamax keeps the inputs and the outputs for every op anyway. The
backward recomputes a, tmat, w, u and the chunk-entry states of one block at
a time (O(L K V) temporaries) instead of keeping the chunk-entry states
(K V 4 / C bytes per token per head, 1 KiB at K = V = 128, C = 64). States
saved under another block size are not reused: the backward then recomputes
the block entries with a state-only forward pass.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member

from tokamax_gdn.ops import numerics
from tokamax_gdn.ops import segments
from tokamax_gdn.ops import tiling

_F32 = jnp.float32
# Diagonal blocks of `invert_unit_lower` (forward substitution inside them).
_SUB_BLOCK = 16


# ----------------------------------------------------------------------------
# Layout: [B, T, ...] <-> chunks.
# ----------------------------------------------------------------------------


def _pad_time(x: jax.Array, tp: int) -> jax.Array:
  """Zero-pads axis 1 (time) of [B, T, ...] to tp."""
  pad = [(0, 0)] * x.ndim
  pad[1] = (0, tp - x.shape[1])
  return jnp.pad(x, pad)


def _to_chunks(x: jax.Array, c: int) -> jax.Array:
  """[B, Tp, ...] -> [N, B, C, ...]."""
  b, tp = x.shape[:2]
  return jnp.moveaxis(x.reshape(b, tp // c, c, *x.shape[2:]), 1, 0)


def _from_chunks(x: jax.Array) -> jax.Array:
  """[N, B, C, ...] -> [B, N*C, ...]."""
  n, b, c = x.shape[:3]
  return jnp.moveaxis(x, 0, 1).reshape(b, n * c, *x.shape[3:])


def _key_side(x, c):
  """[B, Tp, Hk, K] -> [N, B, Hk, C, K]."""
  return jnp.swapaxes(_to_chunks(x, c), 2, 3)


def _key_side_back(x):
  return _from_chunks(jnp.swapaxes(x, 2, 3))


def _value_side(x, c, hk):
  """[B, Tp, Hv, V] -> [N, B, Hk, G, C, V]."""
  x = _to_chunks(x, c)
  n, b, _, hv, d = x.shape
  return jnp.moveaxis(x.reshape(n, b, c, hk, hv // hk, d), 2, 4)


def _value_side_back(x):
  n, b, hk, grp, c, d = x.shape
  return _from_chunks(jnp.moveaxis(x, 4, 2).reshape(n, b, c, hk * grp, d))


def _gate_side(x, c, hk):
  """[B, Tp, Hv] -> [N, B, Hk, G, C]."""
  return _value_side(x[..., None], c, hk)[..., 0]


def _gate_side_back(x):
  return _value_side_back(x[..., None])[..., 0]


def _t(x):
  """Transpose of the last two axes."""
  return jnp.swapaxes(x, -1, -2)


# ----------------------------------------------------------------------------
# Stages (docs/gdn_math.md).
# ----------------------------------------------------------------------------


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["first", "last", "no_start"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Resets:
  """Where segment starts cut a chunk (bool, broadcastable to [..., C]).

  The state stages select with these (`jnp.where`) instead of multiplying by
  the zero decays alone: a state that overflowed in one segment (an unstable
  recurrence) would otherwise give 0 * inf = NaN in the next.
  """

  first: jax.Array      # [..., C] token i is in the segment entering the chunk
  last: jax.Array       # [..., C] token j is in the chunk's last segment
  no_start: jax.Array   # [...] no segment starts in the chunk


def _keep(mask, x):
  """x where `mask` (broadcast over x's trailing axes), else 0; x if mask is None."""
  if mask is None:
    return x
  return jnp.where(mask.reshape(mask.shape + (1,) * (x.ndim - mask.ndim)), x, 0.0)


@dataclasses.dataclass(frozen=True)
class ChunkGate:
  """`chunk_gate`'s outputs, per value head and chunk ([..., C] / [..., C, C])."""

  gcum: tuple[jax.Array, jax.Array]  # [..., C] (hi, lo): G = hi + lo, compensated
  gamma: jax.Array        # [..., C, C] exp(G_i - G_j), j <= i, same segment
  decay_in: jax.Array     # [..., C] exp(G_i) for the segment entering the chunk
  decay_out: jax.Array    # [..., C] exp(G_last - G_j) for the chunk's last segment
  decay_chunk: jax.Array  # [...] exp(G_last) if no segment starts in the chunk
  mask: jax.Array         # [..., C, C] bool: j <= i and same segment (gamma's support)
  resets: Resets | None   # None without segment starts


def compensated_cumsum(g: jax.Array, restart: jax.Array | None):
  """In-chunk cumsum of g [..., C] as an (hi, lo) pair, restarted where
  `restart` (bool, broadcastable) is set: docs/gdn_math.md, "The compensated cumsum".

  An `associative_scan` whose combine adds with TwoSum: hi is the float32
  cumsum and lo collects the rounding errors, so hi + lo keeps the small
  gates that a plain float32 cumsum loses next to a large |G|.
  """
  restart = jnp.zeros(g.shape, bool) if restart is None else jnp.broadcast_to(restart, g.shape)

  def combine(x, y):
    h1, l1, f1 = x
    h2, l2, f2 = y
    h, e = numerics.two_sum(h1, h2)
    return (jnp.where(f2, h2, h), jnp.where(f2, l2, l1 + l2 + e), f1 | f2)

  hi, lo, _ = jax.lax.associative_scan(combine, (g, jnp.zeros_like(g), restart),
                                       axis=g.ndim - 1)
  return hi, lo


def _segment_ids_in_chunk(starts: jax.Array) -> jax.Array:
  """Segment index inside the chunk: 0 for the segment the chunk starts in."""
  return jnp.cumsum(starts.astype(jnp.int32), axis=-1)


def chunk_gate(g: jax.Array, starts: jax.Array | None) -> ChunkGate:
  """Decays of docs/gdn_math.md from the log-decays g [..., C] (float32).

  `starts` [..., C] bool (broadcastable to g) marks segment starts, or None.
  G restarts at each segment start; differences are masked BEFORE exp (never
  the exp of a positive number) and taken as (hi_i - hi_j) + (lo_i - lo_j).
  """
  c = g.shape[-1]
  hi, lo = compensated_cumsum(g, starts)
  causal = jnp.tril(jnp.ones((c, c), bool))
  if starts is None:
    mask = causal
    first = last = no_start = True
  else:
    seg = _segment_ids_in_chunk(starts)
    mask = causal & (seg[..., :, None] == seg[..., None, :])
    first = seg == 0
    last = seg == seg[..., -1:]
    no_start = first[..., -1]
  diff = (hi[..., :, None] - hi[..., None, :]) + (lo[..., :, None] - lo[..., None, :])
  gamma = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
  to_last = (hi[..., -1:] - hi) + (lo[..., -1:] - lo)
  decay_in = jnp.where(first, jnp.exp(jnp.where(first, hi + lo, 0.0)), 0.0)
  decay_out = jnp.where(last, jnp.exp(jnp.where(last, to_last, 0.0)), 0.0)
  g_last = hi[..., -1] + lo[..., -1]
  decay_chunk = jnp.where(no_start, jnp.exp(jnp.where(no_start, g_last, 0.0)), 0.0)
  resets = None if starts is None else Resets(first, last, no_start)
  return ChunkGate((hi, lo), gamma, decay_in, decay_out, decay_chunk, mask, resets)


def invert_unit_lower(a: jax.Array, precision) -> jax.Array:
  """tmat = (I + a)^{-1} for strictly lower-triangular a [..., C, C], float32.

  Forward substitution inside the 16 x 16 diagonal blocks (all at once), then
  block rows below the diagonal by matmuls: docs/gdn_math.md, "The inverse".
  """
  c = a.shape[-1]
  bs = min(_SUB_BLOCK, c)
  nb = c // bs
  eye = jnp.eye(bs, dtype=a.dtype)
  diag = jnp.stack(
      [a[..., i * bs:(i + 1) * bs, i * bs:(i + 1) * bs] for i in range(nb)],
      axis=-3,
  )

  def substitute(i, inv):
    a_i = jax.lax.dynamic_index_in_dim(diag, i, axis=-2, keepdims=True)
    row = jax.lax.dynamic_index_in_dim(eye, i, axis=0, keepdims=True) - jnp.matmul(
        a_i, inv, precision=precision)
    return jax.lax.dynamic_update_index_in_dim(inv, row, i, axis=-2)

  inv = jax.lax.fori_loop(1, bs, substitute, jnp.broadcast_to(eye, diag.shape))
  if nb == 1:
    return inv[..., 0, :, :]
  # Block row i: tmat[rows_i, :i] = -tmat_ii a[rows_i, :i] tmat[:i, :i]
  # (columns >= i masked out), one block row per step with fixed shapes.
  tmat = jnp.zeros_like(a)
  for i in range(nb):
    tmat = tmat.at[..., i * bs:(i + 1) * bs, i * bs:(i + 1) * bs].set(inv[..., i, :, :])
  col_block = jnp.arange(c) // bs

  def block_row(i, tmat):
    rows = jax.lax.dynamic_slice_in_dim(a, i * bs, bs, axis=-2)
    rows = jnp.where(col_block < i, rows, 0.0)
    t_ii = jax.lax.dynamic_index_in_dim(inv, i, axis=-3, keepdims=False)
    lower = -jnp.matmul(t_ii, jnp.matmul(rows, tmat, precision=precision),
                        precision=precision)
    new = jnp.where(col_block < i, lower,
                    jax.lax.dynamic_slice_in_dim(tmat, i * bs, bs, axis=-2))
    return jax.lax.dynamic_update_slice_in_dim(tmat, new, i * bs, axis=-2)

  return jax.lax.fori_loop(1, nb, block_row, tmat)


@dataclasses.dataclass(frozen=True)
class ChunkWy:
  """`chunk_wy`'s outputs: everything of a chunk that does not depend on S."""

  kk: jax.Array      # [N, B, Hk, C, C] K K^T
  qk: jax.Array      # [N, B, Hk, C, C] Q K^T
  a: jax.Array       # [N, B, Hk, G, C, C]
  tmat: jax.Array    # [N, B, Hk, G, C, C]
  k_beta: jax.Array  # [N, B, Hk, G, C, K]
  v_beta: jax.Array  # [N, B, Hk, G, C, V]
  w: jax.Array       # [N, B, Hk, G, C, K]
  u: jax.Array       # [N, B, Hk, G, C, V]
  p: jax.Array       # [N, B, Hk, G, C, C]
  k_out: jax.Array   # [N, B, Hk, G, C, K]


def _dot(precision):
  return dict(precision=precision, preferred_element_type=_F32)


def chunk_wy(q, k, v, beta, gate: ChunkGate, *, scale, precision) -> ChunkWy:
  """The WY (UT) factors of every chunk: q, k [N,B,Hk,C,K], v [N,B,Hk,G,C,V]
  float32, beta [N,B,Hk,G,C] float32."""
  c = q.shape[-2]
  kk = jnp.einsum("nbhik,nbhjk->nbhij", k, k, **_dot(precision))
  qk = jnp.einsum("nbhik,nbhjk->nbhij", q, k, **_dot(precision))
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  a = jnp.where(strict, beta[..., :, None] * kk[:, :, :, None] * gate.gamma, 0.0)
  tmat = invert_unit_lower(a, precision)
  kf = k.astype(_F32)[:, :, :, None]
  k_beta = (beta * gate.decay_in)[..., None] * kf
  v_beta = beta[..., None] * v
  w = jnp.matmul(tmat, k_beta, precision=precision)
  u = jnp.matmul(tmat, v_beta, precision=precision)
  p = scale * qk[:, :, :, None] * gate.gamma
  k_out = gate.decay_out[..., None] * kf
  return ChunkWy(kk, qk, a, tmat, k_beta, v_beta, w, u, p, k_out)


def _first(resets):
  return None if resets is None else resets.first


def _last(resets):
  return None if resets is None else resets.last


def _no_start(resets):
  return None if resets is None else resets.no_start


def _state_step(s, w, u, k_out, decay_chunk, resets, precision):
  """(v_new, s_next) of one chunk: the part of `chunk_state_fwd` that the
  recurrence needs."""
  ws = jnp.einsum("bhgck,bhgkv->bhgcv", w, s, precision=precision)
  v_new = u - _keep(_first(resets), ws)
  s_next = _keep(_no_start(resets), decay_chunk[..., None, None] * s) + jnp.einsum(
      "bhgck,bhgcv->bhgkv", k_out, v_new, precision=precision)
  return v_new, s_next


def chunk_state_fwd(s, q, w, u, p, k_out, decay_in, decay_chunk, resets, *, scale,
                    precision):
  """One chunk's state-dependent forward: (v_new, out, s_next).

  s [B, Hk, G, K, V] float32 (the state entering the chunk); q [B, Hk, C, K];
  the others are one chunk of `ChunkWy` / `ChunkGate`.
  """
  v_new, s_next = _state_step(s, w, u, k_out, decay_chunk, resets, precision)
  qs = jnp.einsum("bhck,bhgkv->bhgcv", q, s, **_dot(precision))
  out = (scale * _keep(_first(resets), decay_in[..., None] * qs)
         + jnp.matmul(p, v_new, precision=precision))
  return v_new, out, s_next


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["d_v_new", "ds_prev", "d_w", "dq", "dk", "d_gcum"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class StateGrads:
  """`chunk_state_bwd`'s outputs for one chunk."""

  d_v_new: jax.Array   # [B, Hk, G, C, V]
  ds_prev: jax.Array   # [B, Hk, G, K, V] gradient of the state entering the chunk
  d_w: jax.Array       # [B, Hk, G, C, K]
  dq: jax.Array        # [B, Hk, C, K] state term of dq
  dk: jax.Array        # [B, Hk, C, K] state term of dk (through k_out)
  d_gcum: jax.Array    # [B, Hk, G, C] state terms (decay_in, decay_out, decay_chunk)


def chunk_state_bwd(s, ds, d_out, q, k, v_new, w, p, k_out, decay_in, decay_out,
                    decay_chunk, resets, *, scale, precision) -> StateGrads:
  """One chunk's state-dependent backward (docs/gdn_math.md, "Backward, state part").

  s: the state entering the chunk; ds: the gradient of the state leaving it
  (s_next); d_out [B, Hk, G, C, V] float32; v_new from the forward.
  """
  ein = lambda spec, *xs: jnp.einsum(spec, *xs, **_dot(precision))
  # Rows outside the entering (first) or last segment are selected out, not
  # multiplied by their zero decays (see `Resets`).
  first, last, no_start = _first(resets), _last(resets), _no_start(resets)
  d_v_new = jnp.matmul(_t(p), d_out, precision=precision) + _keep(
      last, ein("bhgck,bhgkv->bhgcv", k_out, ds))
  d_out_s = _keep(first, ein("bhgcv,bhgkv->bhgck", d_out, s))  # d_out S^T
  ds_prev = (scale * ein("bhck,bhgcv->bhgkv", q, decay_in[..., None] * d_out)
             + _keep(no_start, decay_chunk[..., None, None] * ds)
             - ein("bhgck,bhgcv->bhgkv", w, d_v_new))
  d_w = -_keep(first, ein("bhgcv,bhgkv->bhgck", d_v_new, s))
  dq = scale * jnp.sum(decay_in[..., None] * d_out_s, axis=2)
  d_decay_in = scale * jnp.sum(q[:, :, None].astype(_F32) * d_out_s, axis=-1)
  d_k_out = _keep(last, ein("bhgcv,bhgkv->bhgck", v_new, ds))  # v_new dS^T
  dk = jnp.sum(decay_out[..., None] * d_k_out, axis=2)
  d_decay_out = jnp.sum(k[:, :, None].astype(_F32) * d_k_out, axis=-1)
  d_decay_chunk = _keep(no_start, jnp.sum(s * ds, axis=(-1, -2)))
  # decay_in_i = e^{G_i}, decay_out_j = e^{G_last - G_j}, decay_chunk = e^{G_last}.
  d_gcum = decay_in * d_decay_in - decay_out * d_decay_out
  d_last = jnp.sum(decay_out * d_decay_out, axis=-1) + decay_chunk * d_decay_chunk
  d_gcum = d_gcum.at[..., -1].add(d_last)
  return StateGrads(d_v_new, ds_prev, d_w, dq, dk, d_gcum)


def chunk_wy_bwd(d_w, d_v_new, d_out, v_new, q, k, v, beta, gate: ChunkGate,
                 wy: ChunkWy, *, scale, precision):
  """State-free gradients, batched over chunks (docs/gdn_math.md, "Backward, WY part").

  d_w, d_v_new, d_out, v_new: [N, B, Hk, G, C, *] from the state part.
  Returns (dq, dk, dv, dbeta, d_gcum) of the state-free terms.
  """
  mm = lambda x, y: jnp.matmul(x, y, precision=precision)
  c = q.shape[-2]
  kf, qf = k.astype(_F32), q.astype(_F32)
  d_p = jnp.where(gate.mask, jnp.einsum("nbhgiv,nbhgjv->nbhgij", d_out, v_new,
                                        **_dot(precision)), 0.0)
  # w = tmat k_beta, u = tmat v_beta (d_u = d_v_new);  through tmat = (I + a)^-1:
  # d_a = -tmat^T d_tmat tmat^T with d_tmat = d_w k_beta^T + d_u v_beta^T, i.e.
  # d_a = -(d_k_beta w^T + d_v_beta u^T) (strict lower part, same segment).
  d_k_beta = mm(_t(wy.tmat), d_w)
  d_v_beta = mm(_t(wy.tmat), d_v_new)
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  d_a = -(mm(d_k_beta, _t(wy.w)) + mm(d_v_beta, _t(wy.u)))
  d_a = jnp.where(strict & gate.mask, d_a, 0.0)
  dv = beta[..., None] * d_v_beta
  k_dkb = jnp.sum(kf[:, :, :, None] * d_k_beta, axis=-1)
  dbeta = (jnp.sum(v * d_v_beta, axis=-1) + gate.decay_in * k_dkb
           + jnp.sum(d_a * wy.kk[:, :, :, None] * gate.gamma, axis=-1))
  dk = jnp.sum((beta * gate.decay_in)[..., None] * d_k_beta, axis=3)
  # a = beta_i kk_ij gamma_ij (strict);  p = scale qk_ij gamma_ij.
  d_kk = jnp.sum(d_a * beta[..., :, None] * gate.gamma, axis=3)
  d_qk = scale * jnp.sum(d_p * gate.gamma, axis=3)
  dk += mm(d_kk + _t(d_kk), kf) + mm(_t(d_qk), qf)
  dq = mm(d_qk, kf)
  # gamma_ij = e^{G_i - G_j}: d_gcum_i += sum_j e_ij, d_gcum_j -= sum_i e_ij with
  # e = d_gamma * gamma = d_p p + d_a a;  decay_in through k_beta.
  e = d_p * wy.p + d_a * wy.a
  d_gcum = (jnp.sum(e, axis=-1) - jnp.sum(e, axis=-2)
            + gate.decay_in * beta * k_dkb)
  return dq, dk, dv, dbeta, d_gcum


def chunk_gate_bwd(d_gcum: jax.Array, starts: jax.Array | None) -> jax.Array:
  """dg from d_gcum [..., C]: the transpose of the segment-restarted in-chunk
  cumsum, a reverse cumsum restarted at each segment's last token."""
  if starts is None:
    return jnp.flip(jnp.cumsum(jnp.flip(d_gcum, -1), axis=-1), -1)
  starts = jnp.broadcast_to(starts, d_gcum.shape)
  seg_end = jnp.concatenate([starts[..., 1:], jnp.zeros_like(starts[..., :1])], axis=-1)

  def combine(x, y):
    a, fa = x
    b, fb = y
    return jnp.where(fb, b, a + b), fa | fb

  return jax.lax.associative_scan(combine, (d_gcum, seg_end), reverse=True,
                                  axis=d_gcum.ndim - 1)[0]


# ----------------------------------------------------------------------------
# Blocks and scans.
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Block:
  """One block's inputs in chunk layout and its state-free stages."""

  q: jax.Array       # [N, B, Hk, C, K] input dtype
  k: jax.Array       # [N, B, Hk, C, K] input dtype
  v: jax.Array       # [N, B, Hk, G, C, V] float32
  beta: jax.Array    # [N, B, Hk, G, C] float32
  starts: jax.Array | None  # [N, B, 1, 1, C] bool
  gate: ChunkGate
  wy: ChunkWy


def _prepare(q, k, v, log_decay, beta, starts, *, c, scale, precision) -> _Block:
  """Chunks one block ([B, L, ...], L a multiple of C); runs the state-free stages."""
  hk = q.shape[2]
  qc, kc = _key_side(q, c), _key_side(k, c)
  vc = _value_side(v.astype(_F32), c, hk)
  gc = _gate_side(log_decay.astype(_F32), c, hk)
  bc = _gate_side(beta.astype(_F32), c, hk)
  sc = None if starts is None else _to_chunks(starts, c)[:, :, None, None, :]
  gate = chunk_gate(gc, sc)
  wy = chunk_wy(qc, kc, vc, bc, gate, scale=scale, precision=precision)
  return _Block(qc, kc, vc, bc, sc, gate, wy)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["reset", "segment", "last"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class _SegmentChunks:
  """Per-chunk tables of `segments.SegmentLayout` ([..., B], chunk axes leading):
  the chunk starts `segment` (select its initial state), it is the last chunk
  of `segment` (its exit state is that segment's final state)."""

  reset: jax.Array
  segment: jax.Array
  last: jax.Array


def _bcast(flag, x):
  return flag.reshape(flag.shape + (1,) * (x.ndim - flag.ndim))


def _take_segment_state(x, ctl: _SegmentChunks | None, states, flag_name: str):
  """states[b, n] of the chunk's segment n (zeros if n >= N) where the chunk's
  flag `flag_name` ("reset" or "last") is set (a select), else x."""
  if ctl is None:
    return x
  chosen = segments.state_of_segment(states, ctl.segment)
  return jnp.where(_bcast(getattr(ctl, flag_name), x), chosen, x)


def _put_segment_state(states, x, ctl: _SegmentChunks | None, flag_name: str):
  """states with x stored at [b, n] for the chunk's segment n < N where the
  chunk's flag `flag_name` is set."""
  if ctl is None:
    return states
  return segments.store_segment_state(states, ctl.segment, x, getattr(ctl, flag_name))


def _enter(s, ctl: _SegmentChunks | None, initial):
  """The state entering a chunk: initial[b, n] if it starts segment n < N,
  zeros if it starts a later one, else s."""
  return _take_segment_state(s, ctl, initial, "reset")


def _record(finals, s_next, ctl: _SegmentChunks | None):
  """Keeps s_next as segment n's final state if the chunk ends segment n < N."""
  return _put_segment_state(finals, s_next, ctl, "last")


def _forward_block(q, k, v, log_decay, beta, starts, ctl, carry, initial, *, c, scale,
                   precision):
  """One block of whole chunks: (out [B, L, Hv, V] f32, exit carry).

  carry = (state, per-segment final states or None); `ctl` (or None) and
  `initial` [B, N, Hk, G, K, V] (or None): per-segment states."""
  blk = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                 precision=precision)

  def step(carry, xs):
    s, finals = carry
    ctl, xs = xs
    s = _enter(s, ctl, initial)
    _, out, s_next = chunk_state_fwd(s, *xs, scale=scale, precision=precision)
    return (s_next, _record(finals, s_next, ctl)), out

  carry, out = jax.lax.scan(step, carry, (ctl, _chunk_inputs(blk)))
  return _value_side_back(out), carry


def forward_from_state(q, k, v, log_decay, beta, state, *, chunk_size: int, scale: float,
                       precision) -> tuple[jax.Array, jax.Array]:
  """The chunked forward over one block of whole chunks of one sequence (no
  segments), from `state`: (out [B, L, Hv, V] float32, the state after the
  block [B, Hk, G, K, V] float32).

  q, k [B, L, Hk, K]; v [B, L, Hv, V]; log_decay, beta [B, L, Hv]; L a
  multiple of `chunk_size`; state [B, Hk, G, K, V] float32 (G = Hv / Hk).
  For callers that run their own loop over blocks and carry the state
  between them (the serving op's prefill tiles); `precision`: as
  `matmul_precision` gives it.
  """
  out, (s_next, _) = _forward_block(q, k, v, log_decay, beta, None, None, (state, None), None,
                                    c=chunk_size, scale=scale, precision=precision)
  return out, s_next


def _chunk_inputs(blk: _Block):
  """Per-chunk scan inputs of `chunk_state_fwd`."""
  return (blk.q, blk.wy.w, blk.wy.u, blk.wy.p, blk.wy.k_out, blk.gate.decay_in,
          blk.gate.decay_chunk, blk.gate.resets)


def _entry_states(blk: _Block, ctl, s0, initial, precision):
  """Float32 scan over chunks: (entry states, v_new of every chunk, exit state)."""

  def step(s, xs):
    ctl, xs = xs
    s = _enter(s, ctl, initial)
    v_new, s_next = _state_step(s, *xs, precision)
    return s_next, (s, v_new)

  final, (entries, v_new) = jax.lax.scan(
      step, s0, (ctl, (blk.wy.w, blk.wy.u, blk.wy.k_out, blk.gate.decay_chunk,
                       blk.gate.resets)))
  return entries, v_new, final


def _exit_grad(ds, ctl: _SegmentChunks | None, d_finals):
  """dS leaving a chunk: its segment's final-state cotangent (zeros past N)
  if it is the segment's last chunk, else the next chunk's dS."""
  return _take_segment_state(ds, ctl, d_finals, "last")


def _record_initial_grad(d_initial, ds_prev, ctl: _SegmentChunks | None):
  """Keeps dS entering a chunk that starts segment n < N as d initial[b, n]."""
  return _put_segment_state(d_initial, ds_prev, ctl, "reset")


def _backward_block(q, k, v, log_decay, beta, starts, ctl, d_out, s0, carry, initial,
                    d_finals, *, c, scale, precision):
  """VJP of `_forward_block`: ((dq, dk, dv, d_log_decay, dbeta) in the block's
  [B, L, ...] layout, carry = (dS entering the block, d initial states or None))."""
  blk = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                 precision=precision)
  entries, v_new, _ = _entry_states(blk, ctl, s0, initial, precision)
  d_out = _value_side(d_out.astype(_F32), c, q.shape[2])
  gate, wy = blk.gate, blk.wy

  def step(carry, xs):
    ds, d_initial = carry
    ctl, xs = xs
    grads = chunk_state_bwd(xs[0], _exit_grad(ds, ctl, d_finals), *xs[1:], scale=scale,
                            precision=precision)
    carry = (grads.ds_prev, _record_initial_grad(d_initial, grads.ds_prev, ctl))
    return carry, dataclasses.replace(grads, ds_prev=None)

  carry, sg = jax.lax.scan(
      step, carry,
      (ctl, (entries, d_out, blk.q, blk.k, v_new, wy.w, wy.p, wy.k_out, gate.decay_in,
             gate.decay_out, gate.decay_chunk, gate.resets)),
      reverse=True)
  dq, dk, dv, dbeta, d_gcum = chunk_wy_bwd(
      sg.d_w, sg.d_v_new, d_out, v_new, blk.q, blk.k, blk.v, blk.beta, gate, wy,
      scale=scale, precision=precision)
  d_g = chunk_gate_bwd(d_gcum + sg.d_gcum, blk.starts)
  grads = (_key_side_back(dq + sg.dq), _key_side_back(dk + sg.dk),
           _value_side_back(dv), _gate_side_back(d_g), _gate_side_back(dbeta))
  return grads, carry


def matmul_precision(dtype) -> jax.lax.Precision:
  """The precision of the chunked algebra's matmuls for inputs of `dtype`:
  HIGHEST for float32 (on TPU the default f32 matmul rounds its operands to
  bf16, far outside the 2e-4 float32 contract), DEFAULT otherwise (bf16
  inputs only need the 2e-2 one)."""
  if jnp.dtype(dtype) == jnp.float32:
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def scanned_length(t_len: int, initial_state, chunk_size: int) -> int:
  """Tokens the block scan covers: T, or the aligned length for per-segment
  states (`segments.SegmentLayout`)."""
  if initial_state is None or initial_state.ndim != 5:
    return t_len
  return segments.aligned_length(t_len, initial_state.shape[1], chunk_size)


def block_layout(t_len: int, chunk_size: int, block_size: int) -> tuple[int, int]:
  """(block length L, number of blocks): L = min(block_size, T rounded up to C)."""
  if block_size % chunk_size:
    raise ValueError(f"block_size={block_size} is not a multiple of chunk_size={chunk_size}.")
  length = min(block_size, tiling.round_up(t_len, chunk_size))
  return length, -(-t_len // length)


def _blocked(xs, length: int, n_blocks: int):
  """Pads each [B, T, ...] array (or None) to n_blocks * L -> [NB, B, L, ...]."""
  tp = length * n_blocks
  return tuple(None if x is None else _to_chunks(_pad_time(x, tp), length)
               for x in xs)


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What `chunked_forward` and `chunked_backward` share."""

  blocks: tuple          # (q, k, v, log_decay, beta, starts, ctl) as [NB, B, L, ...]
  s0: jax.Array          # [B, Hk, G, K, V] state entering the first block
  initial: jax.Array | None   # [B, N, Hk, G, K, V] per-segment states, or None
  layout: segments.SegmentLayout | None
  t_len: int             # tokens of the (aligned) sequence the blocks cover
  length: int
  n_blocks: int
  kw: dict


def _setup(q, k, v, log_decay, beta, *, scale, initial_state, segment_ids,
           chunk_size, block_size) -> _Setup:
  """Blocks the inputs; for per-segment states (initial_state [B, N, Hv, K, V])
  first moves them to the chunk-aligned layout of `segments.align_segments`."""
  b, t_len, hk, dim_k = q.shape
  hv, dim_v = v.shape[2:]
  grp = hv // hk
  s0 = jnp.zeros((b, hk, grp, dim_k, dim_v), _F32)
  initial = layout = ctl = None
  if initial_state is not None and initial_state.ndim == 5:
    n_states = initial_state.shape[1]
    initial = initial_state.astype(_F32).reshape(b, n_states, hk, grp, dim_k, dim_v)
    layout = segments.align_segments(segment_ids, n_states, chunk_size)
    q, k, v, log_decay, beta = map(layout.to_aligned, (q, k, v, log_decay, beta))
    starts = layout.in_chunk_starts()
    t_len = layout.aligned_length
  else:
    if initial_state is not None:
      s0 = initial_state.astype(_F32).reshape(s0.shape)
    starts = segments.segment_starts(segment_ids)
  length, n_blocks = block_layout(t_len, chunk_size, block_size)
  blocks = _blocked((q, k, v, log_decay, beta, starts), length, n_blocks)
  if layout is not None:
    # [B, Nc] tables -> [NB, L / C, B] (chunk axis leading inside a block); the
    # padding chunks after the last one neither reset nor end a segment.
    n_chunks = n_blocks * length // chunk_size

    def per_block(x):
      x = jnp.pad(x, ((0, 0), (0, n_chunks - x.shape[1])))
      return jnp.moveaxis(x.reshape(b, n_blocks, length // chunk_size), 0, 2)

    ctl = _SegmentChunks(per_block(layout.chunk_reset), per_block(layout.chunk_segment),
                         per_block(layout.chunk_last))
  kw = dict(c=chunk_size, scale=scale, precision=matmul_precision(q.dtype))
  return _Setup((*blocks, ctl), s0, initial, layout, t_len, length, n_blocks, kw)


def _block_entry_states(st: _Setup):
  """State entering every block, [NB, B, Hk, G, K, V] (a state-only pass)."""

  def body(s, x):
    *x, ctl = x
    blk = _prepare(*x, **st.kw)
    return _entry_states(blk, ctl, s, st.initial, st.kw["precision"])[2], s

  return jax.lax.scan(body, st.s0, st.blocks)[1]


def _first_block(blocks):
  return tuple(jax.tree.map(lambda a: a[0], x) for x in blocks)


def chunked_forward(q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"],
                    v: Float[Array, "B T Hv V"], log_decay: Float[Array, "B T Hv"],
                    beta: Float[Array, "B T Hv"], *, scale: float,
                    initial_state: segments.State | None,
                    segment_ids: Int[Array, "B T"] | None, chunk_size: int,
                    block_size: int = 2048):
  """Chunked forward: (out [B, T, Hv, V] f32, final_state f32, the f32 state
  entering each block [B, Hv, NB, K, V] or None for one block).

  final_state is [B, Hv, K, V], or [B, N, Hv, K, V] for per-segment states
  (`initial_state` [B, N, Hv, K, V] with `segment_ids`)."""
  b, _, _, dim_k = q.shape
  hv, dim_v = v.shape[2:]
  st = _setup(q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
              segment_ids=segment_ids, chunk_size=chunk_size, block_size=block_size)
  finals = None if st.initial is None else jnp.zeros_like(st.initial)
  fwd = functools.partial(_forward_block, initial=st.initial, **st.kw)
  if st.n_blocks == 1:
    out, (final, finals) = fwd(*_first_block(st.blocks), (st.s0, finals))
    out, block_entries = out[None], None
  else:
    def body(carry, x):
      out, carry_next = fwd(*x, carry)
      return carry_next, (out, carry[0])

    (final, finals), (out, block_entries) = jax.lax.scan(body, (st.s0, finals), st.blocks)
    block_entries = jnp.moveaxis(block_entries, 0, 3).reshape(
        b, hv, st.n_blocks, dim_k, dim_v)
  out = _from_chunks(out)[:, :st.t_len]
  if st.layout is None:
    return out, final.reshape(b, hv, dim_k, dim_v), block_entries
  finals = finals.reshape(b, finals.shape[1], hv, dim_k, dim_v)
  return st.layout.from_aligned(out), finals, block_entries


def chunked_backward(q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"],
                     v: Float[Array, "B T Hv V"], log_decay: Float[Array, "B T Hv"],
                     beta: Float[Array, "B T Hv"], d_out: Float[Array, "B T Hv V"],
                     d_final: segments.State | None, *, scale: float,
                     initial_state: segments.State | None,
                     segment_ids: Int[Array, "B T"] | None, chunk_size: int,
                     block_size: int = 2048, block_entries=None):
  """Analytical VJP of `chunked_forward`: (dq, dk, dv, d_log_decay, dbeta,
  d_initial_state).

  `block_entries`: the forward's third output; recomputed when None or saved
  under another block size (block sizes are powers of two, so two of them
  never give the same number of blocks above one).
  """
  b, _, _, dim_k = q.shape
  hv, dim_v = v.shape[2:]
  st = _setup(q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
              segment_ids=segment_ids, chunk_size=chunk_size, block_size=block_size)
  if st.layout is not None:
    d_out = st.layout.to_aligned(d_out)
  (d_out,) = _blocked((d_out,), st.length, st.n_blocks)
  d_finals = d_initial = None
  if st.initial is not None:
    d_initial = jnp.zeros_like(st.initial)
    d_finals = (jnp.zeros_like(st.initial) if d_final is None
                else d_final.astype(_F32).reshape(st.initial.shape))
    ds_final = jnp.zeros_like(st.s0)
  else:
    ds_final = (jnp.zeros_like(st.s0) if d_final is None
                else d_final.astype(_F32).reshape(st.s0.shape))
  bwd = functools.partial(_backward_block, initial=st.initial, d_finals=d_finals,
                          **st.kw)
  if st.n_blocks == 1:
    grads, (d_s0, d_initial) = bwd(*_first_block(st.blocks), d_out[0], st.s0,
                                   (ds_final, d_initial))
    grads = tuple(g[None] for g in grads)
  else:
    if block_entries is None or block_entries.shape[2] != st.n_blocks:
      block_entries = _block_entry_states(st)
    else:  # [B, Hv, NB, K, V] -> [NB, B, Hk, G, K, V]
      block_entries = jnp.moveaxis(
          block_entries.reshape(*st.s0.shape[:3], st.n_blocks, dim_k, dim_v), 3, 0)

    def body(carry, x):
      *x, s_entry = x
      grads, carry = bwd(*x, s_entry, carry)
      return carry, grads

    (d_s0, d_initial), grads = jax.lax.scan(
        body, (ds_final, d_initial), (*st.blocks, d_out, block_entries), reverse=True)
  grads = tuple(_from_chunks(g)[:, :st.t_len] for g in grads)
  if st.layout is None:
    return (*grads, d_s0.reshape(b, hv, dim_k, dim_v))
  grads = tuple(map(st.layout.from_aligned, grads))
  return (*grads, d_initial.reshape(b, d_initial.shape[1], hv, dim_k, dim_v))
