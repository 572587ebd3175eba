"""Chunked gated delta rule in pure JAX: the stages of math.md and their scans.

The notation, the forward and the backward equations are in `math.md` (this
folder); every quantity has the name it has there (`gcum`, `gamma`,
`decay_in`, `decay_out`, `decay_chunk`, `a`, `tmat`, `k_beta`, `v_beta`, `w`,
`u`, `v_new`, `p`, `k_out`, `out`, `s_next`; gradients `d_<name>`), and the
stage functions are math.md's:

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

from tokamax_gdn.ops.gated_delta_rule import base

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
# Stages (math.md).
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChunkGate:
  """`chunk_gate`'s outputs, per value head and chunk ([..., C] / [..., C, C])."""

  gcum: jax.Array         # [..., C] in-chunk cumsum of g
  gamma: jax.Array        # [..., C, C] exp(gcum_i - gcum_j), j <= i, same segment
  decay_in: jax.Array     # [..., C] exp(gcum_i) for the segment entering the chunk
  decay_out: jax.Array    # [..., C] exp(gcum_last - gcum_j) for the chunk's last segment
  decay_chunk: jax.Array  # [...] exp(gcum_last) if no segment starts in the chunk
  mask: jax.Array         # [..., C, C] bool: j <= i and same segment (gamma's support)


def chunk_gate(g: jax.Array, starts: jax.Array | None) -> ChunkGate:
  """Decays of math.md from the log-decays g [..., C] (float32).

  `starts` [..., C] bool (broadcastable to g) marks segment starts, or None.
  Differences are masked BEFORE exp: never the exp of a positive number.
  """
  c = g.shape[-1]
  gcum = jnp.cumsum(g, axis=-1)
  causal = jnp.tril(jnp.ones((c, c), bool))
  if starts is None:
    mask = causal
    first = last = True
  else:
    seg = jnp.cumsum(starts.astype(jnp.int32), axis=-1)
    mask = causal & (seg[..., :, None] == seg[..., None, :])
    first = seg == 0
    last = seg == seg[..., -1:]
  diff = gcum[..., :, None] - gcum[..., None, :]
  gamma = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
  g_last = gcum[..., -1]
  decay_in = jnp.where(first, jnp.exp(gcum), 0.0)
  decay_out = jnp.where(last, jnp.exp(g_last[..., None] - gcum), 0.0)
  decay_chunk = jnp.where(first if starts is None else first[..., -1], jnp.exp(g_last), 0.0)
  return ChunkGate(gcum, gamma, decay_in, decay_out, decay_chunk, mask)


def invert_unit_lower(a: jax.Array, precision) -> jax.Array:
  """tmat = (I + a)^{-1} for strictly lower-triangular a [..., C, C], float32.

  Forward substitution inside the 16 x 16 diagonal blocks (all at once), then
  block rows below the diagonal by matmuls: math.md, "The inverse".
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


def _state_step(s, w, u, k_out, decay_chunk, precision):
  """(v_new, s_next) of one chunk: the part of `chunk_state_fwd` that the
  recurrence needs."""
  v_new = u - jnp.einsum("bhgck,bhgkv->bhgcv", w, s, precision=precision)
  s_next = decay_chunk[..., None, None] * s + jnp.einsum(
      "bhgck,bhgcv->bhgkv", k_out, v_new, precision=precision)
  return v_new, s_next


def chunk_state_fwd(s, q, w, u, p, k_out, decay_in, decay_chunk, *, scale, precision):
  """One chunk's state-dependent forward: (v_new, out, s_next).

  s [B, Hk, G, K, V] float32 (the state entering the chunk); q [B, Hk, C, K];
  the others are one chunk of `ChunkWy` / `ChunkGate`.
  """
  v_new, s_next = _state_step(s, w, u, k_out, decay_chunk, precision)
  qs = jnp.einsum("bhck,bhgkv->bhgcv", q, s, **_dot(precision))
  out = scale * decay_in[..., None] * qs + jnp.matmul(p, v_new, precision=precision)
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
                    decay_chunk, *, scale, precision) -> StateGrads:
  """One chunk's state-dependent backward (math.md, "Backward, state part").

  s: the state entering the chunk; ds: the gradient of the state leaving it
  (s_next); d_out [B, Hk, G, C, V] float32; v_new from the forward.
  """
  ein = lambda spec, *xs: jnp.einsum(spec, *xs, **_dot(precision))
  d_v_new = jnp.matmul(_t(p), d_out, precision=precision) + ein(
      "bhgck,bhgkv->bhgcv", k_out, ds)
  d_out_s = ein("bhgcv,bhgkv->bhgck", d_out, s)                # d_out S^T
  ds_prev = (scale * ein("bhck,bhgcv->bhgkv", q, decay_in[..., None] * d_out)
             + decay_chunk[..., None, None] * ds
             - ein("bhgck,bhgcv->bhgkv", w, d_v_new))
  d_w = -ein("bhgcv,bhgkv->bhgck", d_v_new, s)
  dq = scale * jnp.sum(decay_in[..., None] * d_out_s, axis=2)
  d_decay_in = scale * jnp.sum(q[:, :, None].astype(_F32) * d_out_s, axis=-1)
  d_k_out = ein("bhgcv,bhgkv->bhgck", v_new, ds)               # v_new dS^T
  dk = jnp.sum(decay_out[..., None] * d_k_out, axis=2)
  d_decay_out = jnp.sum(k[:, :, None].astype(_F32) * d_k_out, axis=-1)
  d_decay_chunk = jnp.sum(s * ds, axis=(-1, -2))
  # decay_in_i = e^{G_i}, decay_out_j = e^{G_last - G_j}, decay_chunk = e^{G_last}.
  d_gcum = decay_in * d_decay_in - decay_out * d_decay_out
  d_last = jnp.sum(decay_out * d_decay_out, axis=-1) + decay_chunk * d_decay_chunk
  d_gcum = d_gcum.at[..., -1].add(d_last)
  return StateGrads(d_v_new, ds_prev, d_w, dq, dk, d_gcum)


def chunk_wy_bwd(d_w, d_v_new, d_out, v_new, q, k, v, beta, gate: ChunkGate,
                 wy: ChunkWy, *, scale, precision):
  """State-free gradients, batched over chunks (math.md, "Backward, WY part").

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
  """dg from d_gcum [..., C]: the transpose of the in-chunk cumsum (a reverse
  cumsum)."""
  del starts
  return jnp.flip(jnp.cumsum(jnp.flip(d_gcum, -1), axis=-1), -1)


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


def _chunk_inputs(blk: _Block):
  """Per-chunk scan inputs of `chunk_state_fwd`."""
  return (blk.q, blk.wy.w, blk.wy.u, blk.wy.p, blk.wy.k_out, blk.gate.decay_in,
          blk.gate.decay_chunk)


def _forward_block(q, k, v, log_decay, beta, starts, s0, *, c, scale, precision):
  """One block of whole chunks: (out [B, L, Hv, V] f32, exit state)."""
  blk = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                 precision=precision)

  def step(s, xs):
    _, out, s_next = chunk_state_fwd(s, *xs, scale=scale, precision=precision)
    return s_next, out

  final, out = jax.lax.scan(step, s0, _chunk_inputs(blk))
  return _value_side_back(out), final


def _entry_states(blk: _Block, s0, precision):
  """Float32 scan over chunks: (entry states, v_new of every chunk, exit state)."""

  def step(s, xs):
    v_new, s_next = _state_step(s, *xs, precision)
    return s_next, (s, v_new)

  final, (entries, v_new) = jax.lax.scan(
      step, s0, (blk.wy.w, blk.wy.u, blk.wy.k_out, blk.gate.decay_chunk))
  return entries, v_new, final


def _backward_block(q, k, v, log_decay, beta, starts, d_out, s0, ds_final, *, c,
                    scale, precision):
  """VJP of `_forward_block`: ((dq, dk, dv, d_log_decay, dbeta) in the block's
  [B, L, ...] layout, d_s0)."""
  blk = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                 precision=precision)
  entries, v_new, _ = _entry_states(blk, s0, precision)
  d_out = _value_side(d_out.astype(_F32), c, q.shape[2])
  gate, wy = blk.gate, blk.wy

  def step(ds, xs):
    s, d_out, q, k, v_new, w, p, k_out, decay_in, decay_out, decay_chunk = xs
    grads = chunk_state_bwd(s, ds, d_out, q, k, v_new, w, p, k_out, decay_in,
                            decay_out, decay_chunk, scale=scale, precision=precision)
    return grads.ds_prev, dataclasses.replace(grads, ds_prev=None)

  d_s0, sg = jax.lax.scan(
      step, ds_final,
      (entries, d_out, blk.q, blk.k, v_new, wy.w, wy.p, wy.k_out, gate.decay_in,
       gate.decay_out, gate.decay_chunk),
      reverse=True)
  dq, dk, dv, dbeta, d_gcum = chunk_wy_bwd(
      sg.d_w, sg.d_v_new, d_out, v_new, blk.q, blk.k, blk.v, blk.beta, gate, wy,
      scale=scale, precision=precision)
  d_g = chunk_gate_bwd(d_gcum + sg.d_gcum, blk.starts)
  grads = (_key_side_back(dq + sg.dq), _key_side_back(dk + sg.dk),
           _value_side_back(dv), _gate_side_back(d_g), _gate_side_back(dbeta))
  return grads, d_s0


def _precision(dtype):
  # On TPU the default f32 matmul rounds operands to bf16, far outside the
  # 2e-4 float32 contract; bf16 inputs only need the 2e-2 one.
  if jnp.dtype(dtype) == jnp.float32:
    return jax.lax.Precision.HIGHEST
  return jax.lax.Precision.DEFAULT


def _initial(initial_state, b, hk, grp, dk, dv):
  if initial_state is None:
    return jnp.zeros((b, hk, grp, dk, dv), _F32)
  return initial_state.astype(_F32).reshape(b, hk, grp, dk, dv)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def block_layout(t_len: int, chunk_size: int, block_size: int) -> tuple[int, int]:
  """(block length L, number of blocks): L = min(block_size, T rounded up to C)."""
  if block_size % chunk_size:
    raise ValueError(f"block_size={block_size} is not a multiple of chunk_size={chunk_size}.")
  length = min(block_size, _round_up(t_len, chunk_size))
  return length, -(-t_len // length)


def _blocked(xs, length: int, n_blocks: int):
  """Pads each [B, T, ...] array (or None) to n_blocks * L -> [NB, B, L, ...]."""
  tp = length * n_blocks
  return tuple(None if x is None else _to_chunks(_pad_time(x, tp), length)
               for x in xs)


def _setup(q, k, v, log_decay, beta, *, scale, initial_state, segment_ids,
           chunk_size, block_size):
  """(inputs as [NB, B, L, ...] blocks, s0 [B, Hk, G, K, V], L, NB, the block
  functions' keyword arguments) for `chunked_forward` / `chunked_backward`."""
  b, t_len, hk, dk = q.shape
  hv, dv = v.shape[2:]
  starts = base.segment_starts(segment_ids, t_len)
  length, n_blocks = block_layout(t_len, chunk_size, block_size)
  blocks = _blocked((q, k, v, log_decay, beta, starts), length, n_blocks)
  s0 = _initial(initial_state, b, hk, hv // hk, dk, dv)
  kw = dict(c=chunk_size, scale=scale, precision=_precision(q.dtype))
  return blocks, s0, length, n_blocks, kw


def _block_entry_states(blocks, s0, *, c, scale, precision):
  """State entering every block, [NB, B, Hk, G, K, V] (a state-only pass)."""

  def body(s, x):
    blk = _prepare(*x, c=c, scale=scale, precision=precision)
    return _entry_states(blk, s, precision)[2], s

  return jax.lax.scan(body, s0, blocks)[1]


def chunked_forward(q, k, v, log_decay, beta, *, scale, initial_state,
                    segment_ids, chunk_size, block_size=2048):
  """Chunked forward: (out [B, T, Hv, V] f32, final_state [B, Hv, K, V] f32,
  the f32 state entering each block [B, Hv, NB, K, V], None for one block)."""
  b, t_len, _, dk = q.shape
  hv, dv = v.shape[2:]
  blocks, s0, _, n_blocks, kw = _setup(
      q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
      segment_ids=segment_ids, chunk_size=chunk_size, block_size=block_size)
  fwd = functools.partial(_forward_block, **kw)
  if n_blocks == 1:
    out, final = fwd(*(x if x is None else x[0] for x in blocks), s0)
    out, block_entries = out[None], None
  else:
    def body(s, x):
      out, s_next = fwd(*x, s)
      return s_next, (out, s)

    final, (out, block_entries) = jax.lax.scan(body, s0, blocks)
    block_entries = jnp.moveaxis(block_entries, 0, 3).reshape(
        b, hv, n_blocks, dk, dv)
  out = _from_chunks(out)[:, :t_len]
  return out, final.reshape(b, hv, dk, dv), block_entries


def chunked_backward(q, k, v, log_decay, beta, d_out, d_final, *, scale,
                     initial_state, segment_ids, chunk_size, block_size=2048,
                     block_entries=None):
  """Analytical VJP of `chunked_forward`: (dq, dk, dv, d_log_decay, dbeta,
  d_initial_state).

  `block_entries`: the forward's third output; recomputed when None or saved
  under another block size (block sizes are powers of two, so two of them
  never give the same number of blocks above one).
  """
  b, t_len, _, dim_k = q.shape
  hv, dim_v = v.shape[2:]
  blocks, s0, length, n_blocks, kw = _setup(
      q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
      segment_ids=segment_ids, chunk_size=chunk_size, block_size=block_size)
  (d_out,) = _blocked((d_out,), length, n_blocks)
  ds_final = (jnp.zeros_like(s0) if d_final is None
              else d_final.astype(_F32).reshape(s0.shape))
  if n_blocks == 1:
    grads, d_s0 = _backward_block(*(x if x is None else x[0] for x in blocks),
                                  d_out[0], s0, ds_final, **kw)
    grads = tuple(g[None] for g in grads)
  else:
    if block_entries is None or block_entries.shape[2] != n_blocks:
      block_entries = _block_entry_states(blocks, s0, **kw)
    else:  # [B, Hv, NB, K, V] -> [NB, B, Hk, G, K, V]
      block_entries = jnp.moveaxis(
          block_entries.reshape(*s0.shape[:3], n_blocks, dim_k, dim_v), 3, 0)

    def body(ds, x):
      *x, s_entry = x
      grads, d_s = _backward_block(*x, s_entry, ds, **kw)
      return d_s, grads

    d_s0, grads = jax.lax.scan(body, ds_final, (*blocks, d_out, block_entries),
                               reverse=True)
  grads = tuple(_from_chunks(g)[:, :t_len] for g in grads)
  return (*grads, d_s0.reshape(b, hv, dim_k, dim_v))
