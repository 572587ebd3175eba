"""Chunked (WY / UT) gated delta rule in pure JAX, with an analytical backward.

Notation (code symbols), per batch b, value head h (key head h // group) and
chunk of C tokens; `starts` marks segment starts, `seg_i` = number of starts
in the chunk at positions <= i:

  gcum_i  = sum_{j<=i} g_j                        (in-chunk cumsum, <= 0)
  same_ij = seg_i == seg_j;  first_i = seg_i == 0;  last_i = seg_i == seg_{C-1}
  gamma_ij = exp(gcum_i - gcum_j)  if i >= j and same_ij else 0
             (the difference is masked BEFORE exp: never exp of a positive)
  e_g_i   = exp(gcum_i) * first_i                 decay from the chunk entry
  dec_j   = exp(gcum_{C-1} - gcum_j) * last_j     decay to the chunk exit
  e_gc    = exp(gcum_{C-1}) * first_{C-1}         carry of the entry state
  a       = tril_{-1}(beta_i (k k^T)_ij gamma_ij);   t = (I + a)^{-1}
  w       = t (beta * e_g * k);   u = t (beta * v)
  delta   = u - w s                               (s: state at chunk entry)
  p       = scale * (q k^T) * gamma               (tril_0 through gamma)
  out     = scale * e_g * (q s) + p delta
  s_next  = e_gc * s + k^T (dec * delta)

`t` comes from forward substitution on 16x16 diagonal blocks plus block
back-substitution by matmul. GVA: k-side products are computed once per key
head, value heads are laid out as [Hk, group] and broadcast.

Two levels of scan keep the cost linear in T. The sequence is cut into blocks
of `Config.block_size` tokens (L, a multiple of C; one block when T <= L); an
outer float32 `lax.scan` over blocks carries s. Within a block, everything
that does not depend on s is batched over the block's L / C chunks, and an
inner `lax.scan` over chunks carries s. So temporaries are O(L C) per head
rather than O(T C), and they stay in cache on CPU. T is padded internally to
a multiple of L (beta = 0, g = 0, k = 0 on the tail: the state passes
through unchanged). A segment start at a block's first token is an ordinary
in-chunk start (e_g = e_gc = 0), so nothing leaks across it either way.

Backward: an outer reverse scan over blocks carrying ds, each block started
from its saved entry state; within a block a reverse scan over chunks carrying
ds = dL/ds_next:
  d_delta  = p^T dout + dec * (k ds)
  ds_prev  = scale q^T (e_g * dout) + e_gc ds - w^T d_delta
then, batched over chunks: dp = dout delta^T, dw = -d_delta s^T, du = d_delta,
d(beta e_g k) = t^T dw, d(beta v) = t^T du, da = -(t^T dw w^T + t^T du u^T)
restricted to the strict lower part (the gradient of t = (I + a)^{-1} without
forming dt), and the log-decay gradient per token from e_g, gamma (row sums
minus column sums of dp*p + da*a), dec and e_gc, followed by a reverse cumsum
within the chunk to undo gcum.

Saved vs recomputed: the op's own residuals are the float32 states entering
each block, `base.Residuals.states` [B, Hv, T / L, K, V] (None for a single
block): K V 4 / L bytes per token per value head, 32 B at K = V = 128 and
L = 2048 (128 B at L = 512). tokamax keeps the inputs and the outputs for
every op anyway (for `out` that is V * itemsize bytes per token per head,
512 B at V = 128 f32). The backward recomputes a, t, w, u and the chunk-entry
states of one block at a time (O(L K V) temporaries) instead of keeping the
chunk-entry states (K V 4 / C bytes per token per head, 1 KiB at K = V = 128,
C = 64). States saved under another block size are not reused: the backward
then recomputes the block entries with a state-only forward pass.
"""

import dataclasses
import functools
import typing
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op
from typing_extensions import override

from tokamax_gdn.ops.gated_delta_rule import base

_F32 = jnp.float32
_SUB_BLOCK = 16


BlockSize = Literal[256, 512, 1024, 2048, 4096, 8192, 16384]
_DEFAULT_BLOCK = 2048


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the chunked computation.

  chunk_size: tokens per chunk of the WY/UT decomposition (C x C matrices).
  block_size: tokens per block of the outer scan. Chunk-parallel work
    (the C x C matrices, WY factors) is batched over one block's chunks at a
    time, so temporaries are O(block_size) instead of O(T) and the cost stays
    linear in T; the forward saves the f32 state entering each block
    (K V 4 / block_size bytes per token and value head) for the backward.
  """

  chunk_size: Literal[16, 32, 64, 128] = 64
  block_size: BlockSize = _DEFAULT_BLOCK


def _heuristics(t: int) -> Config:
  """C=64 (16/32 for shorter sequences); blocks of 512 tokens on CPU, 2048
  elsewhere.

  On the 2-core CPU (f32, K=V=128, fwd+bwd) blocks of 512 tokens kept the
  per-block temporaries in cache: T=8192 Hv=4: 333 ms vs 429 ms at 2048;
  T=4096 Hv=16: 578 ms vs 755 ms. Accelerators get longer blocks, since
  each block is a sequential step and its chunks are the parallel width.
  """
  block = 512 if jax.default_backend() == "cpu" else _DEFAULT_BLOCK
  for c in (16, 32):
    if t <= c:
      return Config(chunk_size=c, block_size=block)
  return Config(chunk_size=64, block_size=block)


def _autotuning_configs(t: int) -> set[Config]:
  """Chunk sizes at the heuristic block, block sizes at C=64.

  Block sizes of T or more all run as one block; only the smallest is kept.
  """
  block = _heuristics(t).block_size
  configs = {Config(chunk_size=c, block_size=block) for c in (16, 32, 64, 128)}
  for blk in typing.get_args(BlockSize):
    if blk // 2 < t:
      configs.add(Config(chunk_size=64, block_size=blk))
  return configs


# ----------------------------------------------------------------------------
# Chunk layout helpers.
# ----------------------------------------------------------------------------


def _pad_time(x: jax.Array, tp: int) -> jax.Array:
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


def _invert_unit_lower(a: jax.Array, precision) -> jax.Array:
  """(I + a)^{-1} for strictly lower-triangular a [..., C, C], float32."""
  c = a.shape[-1]
  bs = min(_SUB_BLOCK, c)
  nb = c // bs
  eye = jnp.eye(bs, dtype=a.dtype)
  # Diagonal blocks by forward substitution, all blocks at once.
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
  # Block rows below the diagonal, one per step with fixed shapes:
  # t[rows_i, :i] = -t_ii a[rows_i, :i] t[:i, :i]  (columns >= i masked out).
  t = jnp.zeros_like(a)
  for i in range(nb):  # block-diagonal start
    t = t.at[..., i * bs:(i + 1) * bs, i * bs:(i + 1) * bs].set(inv[..., i, :, :])
  col_block = jnp.arange(c) // bs

  def block_row(i, t):
    rows = jax.lax.dynamic_slice_in_dim(a, i * bs, bs, axis=-2)
    rows = jnp.where(col_block < i, rows, 0.0)
    t_ii = jax.lax.dynamic_index_in_dim(inv, i, axis=-3, keepdims=False)
    lower = -jnp.matmul(t_ii, jnp.matmul(rows, t, precision=precision),
                        precision=precision)
    new = jnp.where(col_block < i, lower,
                    jax.lax.dynamic_slice_in_dim(t, i * bs, bs, axis=-2))
    return jax.lax.dynamic_update_slice_in_dim(t, new, i * bs, axis=-2)

  t = jax.lax.fori_loop(1, nb, block_row, t)
  return t


@dataclasses.dataclass(frozen=True)
class _Chunks:
  """Per-chunk quantities shared by the forward and the backward."""

  q: jax.Array      # [N, B, Hk, C, K] input dtype
  k: jax.Array      # [N, B, Hk, C, K] input dtype
  v: jax.Array      # [N, B, Hk, G, C, V] float32
  beta: jax.Array   # [N, B, Hk, G, C] float32
  mask: jax.Array   # [N, B, 1, 1, C, C] bool: i >= j and same segment
  e_g: jax.Array    # [N, B, Hk, G, C]
  dec: jax.Array    # [N, B, Hk, G, C]
  e_gc: jax.Array   # [N, B, Hk, G]
  gamma: jax.Array  # [N, B, Hk, G, C, C]
  kk: jax.Array     # [N, B, Hk, C, C] k k^T
  qk: jax.Array     # [N, B, Hk, C, C] q k^T
  a: jax.Array      # [N, B, Hk, G, C, C]
  t: jax.Array      # [N, B, Hk, G, C, C]
  kb: jax.Array     # [N, B, Hk, G, C, K] beta * e_g * k
  w: jax.Array      # [N, B, Hk, G, C, K]
  u: jax.Array      # [N, B, Hk, G, C, V]
  p: jax.Array      # [N, B, Hk, G, C, C] scale * qk * gamma


def _prepare(q, k, v, log_decay, beta, starts, *, c, scale, precision):
  """Chunks one block ([B, L, ...], L a multiple of C) and computes everything
  that does not depend on the state."""
  hk = q.shape[2]
  qc = _key_side(q, c)
  kc = _key_side(k, c)
  vc = _value_side(v.astype(_F32), c, hk)
  gc = _gate_side(log_decay.astype(_F32), c, hk)
  bc = _gate_side(beta.astype(_F32), c, hk)
  gcum = jnp.cumsum(gc, axis=-1)
  causal = jnp.tril(jnp.ones((c, c), bool))
  if starts is None:
    mask = jnp.broadcast_to(causal, (1, 1, 1, 1, c, c))
    first = last = jnp.ones((1, 1, 1, 1, c), bool)
  else:
    seg = jnp.cumsum(_to_chunks(starts.astype(jnp.int32), c), axis=-1)
    seg = seg[:, :, None, None, :]                       # [N, B, 1, 1, C]
    mask = causal & (seg[..., :, None] == seg[..., None, :])
    first = seg == 0
    last = seg == seg[..., -1:]
  diff = gcum[..., :, None] - gcum[..., None, :]
  gamma = jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
  e_g = jnp.where(first, jnp.exp(gcum), 0.0)
  g_last = gcum[..., -1]
  dec = jnp.where(last, jnp.exp(g_last[..., None] - gcum), 0.0)
  e_gc = jnp.where(first[..., -1], jnp.exp(g_last), 0.0)

  dot = dict(precision=precision, preferred_element_type=_F32)
  kk = jnp.einsum("nbhik,nbhjk->nbhij", kc, kc, **dot)
  qk = jnp.einsum("nbhik,nbhjk->nbhij", qc, kc, **dot)
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  a = jnp.where(strict, bc[..., :, None] * kk[:, :, :, None] * gamma, 0.0)
  t = _invert_unit_lower(a, precision)
  kb = (bc * e_g)[..., None] * kc[:, :, :, None].astype(_F32)
  w = jnp.matmul(t, kb, precision=precision)
  u = jnp.matmul(t, bc[..., None] * vc, precision=precision)
  p = scale * qk[:, :, :, None] * gamma
  return _Chunks(qc, kc, vc, bc, mask, e_g, dec, e_gc, gamma, kk, qk, a, t,
                 kb, w, u, p)


def _entry_states(ch: _Chunks, s0: jax.Array, precision):
  """Float32 scan over chunks: (entry states, delta of every chunk, final)."""

  def step(s, xs):
    w, u, k, dec, e_gc = xs
    delta = u - jnp.einsum("bhgck,bhgkv->bhgcv", w, s, precision=precision)
    upd = jnp.einsum("bhck,bhgcv->bhgkv", k.astype(_F32), dec[..., None] * delta,
                     precision=precision)
    return e_gc[..., None, None] * s + upd, (s, delta)

  final, (entries, delta) = jax.lax.scan(
      step, s0, (ch.w, ch.u, ch.k, ch.dec, ch.e_gc))
  return entries, delta, final


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


def _layout(t_len: int, chunk_size: int, block_size: int) -> tuple[int, int]:
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


def _forward_block(q, k, v, log_decay, beta, starts, s0, *, c, scale, precision):
  """One block of whole chunks: (out [B, L, Hv, V] f32, exit state)."""
  ch = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                precision=precision)
  entries, delta, final = _entry_states(ch, s0, precision)
  inter = jnp.einsum("nbhck,nbhgkv->nbhgcv", ch.q, entries, precision=precision,
                     preferred_element_type=_F32)
  out = scale * ch.e_g[..., None] * inter + jnp.matmul(
      ch.p, delta, precision=precision)
  return _value_side_back(out), final


def _block_entry_states(blocks, s0, *, c, scale, precision):
  """State entering every block, [NB, B, Hk, G, K, V] (a state-only pass)."""

  def body(s, x):
    ch = _prepare(*x, c=c, scale=scale, precision=precision)
    return _entry_states(ch, s, precision)[2], s

  return jax.lax.scan(body, s0, blocks)[1]


def _setup(q, k, v, log_decay, beta, *, scale, initial_state, segment_ids,
           chunk_size, block_size):
  """(inputs as [NB, B, L, ...] blocks, s0 [B, Hk, G, K, V], L, NB, the block
  functions' keyword arguments) for `chunked_forward` / `chunked_backward`."""
  b, t_len, hk, dk = q.shape
  hv, dv = v.shape[2:]
  starts = base.segment_starts(segment_ids, t_len)
  length, n_blocks = _layout(t_len, chunk_size, block_size)
  blocks = _blocked((q, k, v, log_decay, beta, starts), length, n_blocks)
  s0 = _initial(initial_state, b, hk, hv // hk, dk, dv)
  kw = dict(c=chunk_size, scale=scale, precision=_precision(q.dtype))
  return blocks, s0, length, n_blocks, kw


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


def _backward_block(q, k, v, log_decay, beta, starts, do, s0, ds_final, *, c,
                    scale, precision):
  """VJP of `_forward_block`: ((dq, dk, dv, d_log_decay, d_beta) in the block's
  [B, L, ...] layout, d_s0)."""
  mm = lambda x, y: jnp.matmul(x, y, precision=precision)
  ein = lambda s, *xs: jnp.einsum(s, *xs, precision=precision,
                                  preferred_element_type=_F32)
  ch = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                precision=precision)
  entries, delta, _ = _entry_states(ch, s0, precision)
  do = _value_side(do.astype(_F32), c, q.shape[2])
  pt_do = mm(jnp.swapaxes(ch.p, -1, -2), do)                  # p^T dout
  q_do = scale * ein("nbhck,nbhgcv->nbhgkv", ch.q, ch.e_g[..., None] * do)
  kf = ch.k.astype(_F32)

  def step(ds, xs):
    pt_do, q_do, k, dec, e_gc, w = xs
    d_delta = pt_do + dec[..., None] * ein("bhck,bhgkv->bhgcv", k, ds)
    ds_prev = q_do + e_gc[..., None, None] * ds - ein(
        "bhgck,bhgcv->bhgkv", w, d_delta)
    return ds_prev, (ds, d_delta)

  d_s0, (ds_exit, d_delta) = jax.lax.scan(
      step, ds_final, (pt_do, q_do, kf, ch.dec, ch.e_gc, ch.w), reverse=True)
  # Output: out = scale e_g (q s) + p delta.
  dp = jnp.where(ch.mask, ein("nbhgiv,nbhgjv->nbhgij", do, delta), 0.0)
  do_st = ein("nbhgcv,nbhgkv->nbhgck", do, entries)           # dout s^T
  d_e_g = scale * jnp.sum(ch.q[:, :, :, None] * do_st, axis=-1)
  dq = scale * jnp.sum(ch.e_g[..., None] * do_st, axis=3)
  # State update: s_next = e_gc s + k^T (dec delta).
  dkd = ein("nbhgcv,nbhgkv->nbhgck", delta, ds_exit)           # delta ds^T
  dk = jnp.sum(ch.dec[..., None] * dkd, axis=3)
  d_dec = jnp.sum(kf[:, :, :, None] * dkd, axis=-1)
  d_e_gc = jnp.sum(entries * ds_exit, axis=(-1, -2))
  # delta = u - w s with u = t (beta v), w = t (beta e_g k).
  dw = -ein("nbhgcv,nbhgkv->nbhgck", d_delta, entries)
  t_t = jnp.swapaxes(ch.t, -1, -2)
  dkb = mm(t_t, dw)
  dvb = mm(t_t, d_delta)
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  da = -(mm(dkb, jnp.swapaxes(ch.w, -1, -2))
         + mm(dvb, jnp.swapaxes(ch.u, -1, -2)))
  da = jnp.where(strict & ch.mask, da, 0.0)
  dv_ = ch.beta[..., None] * dvb
  d_beta = jnp.sum(ch.v * dvb, axis=-1)
  k_dkb = jnp.sum(kf[:, :, :, None] * dkb, axis=-1)
  d_beta += ch.e_g * k_dkb
  d_e_g += ch.beta * k_dkb
  dk += jnp.sum((ch.beta * ch.e_g)[..., None] * dkb, axis=3)
  # a = beta_i kk_ij gamma_ij (strict);  p = scale qk_ij gamma_ij.
  da_bg = da * ch.beta[..., :, None] * ch.gamma
  d_beta += jnp.sum(da * ch.kk[:, :, :, None] * ch.gamma, axis=-1)
  dkk = jnp.sum(da_bg, axis=3)
  dqk = scale * jnp.sum(dp * ch.gamma, axis=3)
  dk += mm(dkk + jnp.swapaxes(dkk, -1, -2), kf)
  dk += mm(jnp.swapaxes(dqk, -1, -2), ch.q.astype(_F32))
  dq += mm(dqk, kf)
  # Log-decay: gradient per cumulative gate, then reverse cumsum.
  e = dp * ch.p + da * ch.a
  d_gcum = ch.e_g * d_e_g + jnp.sum(e, axis=-1) - jnp.sum(e, axis=-2)
  d_gcum -= ch.dec * d_dec
  last = jnp.sum(ch.dec * d_dec, axis=-1) + ch.e_gc * d_e_gc
  d_gcum = d_gcum.at[..., -1].add(last)
  d_g = jnp.flip(jnp.cumsum(jnp.flip(d_gcum, -1), axis=-1), -1)
  grads = (_key_side_back(dq), _key_side_back(dk), _value_side_back(dv_),
           _gate_side_back(d_g), _gate_side_back(d_beta))
  return grads, d_s0


def chunked_backward(q, k, v, log_decay, beta, d_out, d_final, *, scale,
                     initial_state, segment_ids, chunk_size, block_size=2048,
                     block_entries=None):
  """Analytical VJP of `chunked_forward` (see the module docstring).

  `block_entries`: the forward's third output; recomputed when None or saved
  under another block size (block sizes are powers of two, so two of them
  never give the same number of blocks above one).
  """
  b, t_len, _, d_key = q.shape
  hv, d_val = v.shape[2:]
  blocks, s0, length, n_blocks, kw = _setup(
      q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
      segment_ids=segment_ids, chunk_size=chunk_size, block_size=block_size)
  (do,) = _blocked((d_out,), length, n_blocks)
  ds_final = (jnp.zeros_like(s0) if d_final is None
              else d_final.astype(_F32).reshape(s0.shape))
  if n_blocks == 1:
    grads, d_s0 = _backward_block(*(x if x is None else x[0] for x in blocks),
                                  do[0], s0, ds_final, **kw)
    grads = tuple(g[None] for g in grads)
  else:
    if block_entries is None or block_entries.shape[2] != n_blocks:
      block_entries = _block_entry_states(blocks, s0, **kw)
    else:  # [B, Hv, NB, K, V] -> [NB, B, Hk, G, K, V]
      block_entries = jnp.moveaxis(
          block_entries.reshape(*s0.shape[:3], n_blocks, d_key, d_val), 3, 0)

    def body(ds, x):
      *x, s_entry = x
      grads, d_s = _backward_block(*x, s_entry, ds, **kw)
      return d_s, grads

    d_s0, grads = jax.lax.scan(body, ds_final, (*blocks, do, block_entries),
                               reverse=True)
  grads = tuple(_from_chunks(g)[:, :t_len] for g in grads)
  return (*grads, d_s0.reshape(b, hv, d_key, d_val))


@dataclasses.dataclass(frozen=True)
class XlaGatedDeltaRule(base.GatedDeltaRule[Config, Any]):
  """Chunked WY/UT gated delta rule lowered by XLA; analytical backward."""

  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = base.CHUNKED_LOG_DECAY_FLOOR

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", XlaGatedDeltaRuleVjp())

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    return _heuristics(ba.arguments["query"].shape[1])

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    return _autotuning_configs(ba.arguments["query"].shape[1])

  @override
  def _core_fwd(self, q, k, v, log_decay, beta, *, scale, initial_state,
                segment_ids, config):
    out, final, block_entries = chunked_forward(
        q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=config.chunk_size,
        block_size=config.block_size)
    return out, final, base.Residuals(states=block_entries)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaGatedDeltaRuleVjp(base.GatedDeltaRuleVjp[Config, Any]):
  """Analytical backward of `XlaGatedDeltaRule` (reverse scan over blocks).

  It runs over the forward's blocks, whose entry states it gets as residuals:
  `block_size` of its config applies only without residuals (called on its
  own), so it autotunes the chunk size alone.
  """

  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = base.CHUNKED_LOG_DECAY_FLOOR

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    return _heuristics(ba.arguments["query"].shape[1])

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    block = self._get_heuristics_config(ba).block_size
    return {Config(chunk_size=c, block_size=block) for c in (16, 32, 64, 128)}

  @override
  def _core_bwd(self, residuals, q, k, v, log_decay, beta, d_out, d_final, *,
                scale, initial_state, segment_ids, config):
    t_len, chunk = q.shape[1], config.chunk_size
    block, states = config.block_size, None
    if residuals is not None:
      block = _forward_block_size(t_len, chunk, residuals.states)
      states = residuals.states
    return chunked_backward(
        q, k, v, log_decay, beta, d_out, d_final, scale=scale,
        initial_state=initial_state, segment_ids=segment_ids,
        chunk_size=chunk, block_size=block, block_entries=states)


def _forward_block_size(t_len: int, chunk: int, states: jax.Array | None) -> int:
  """The forward's block length, from the number of block states it saved.

  None: it ran as one block, so the backward does too. Otherwise the block
  size with that many blocks, unique among the powers of two of `BlockSize`
  (ceil(T / L) > ceil(T / 2L) whenever the latter is above one).
  """
  if states is None:
    return _round_up(t_len, chunk)
  for blk in typing.get_args(BlockSize):
    if -(-t_len // blk) == states.shape[2]:
      return blk
  raise ValueError(f"{states.shape[2]} saved block states fit no block size at T={t_len}.")


IMPLEMENTATION = XlaGatedDeltaRule()
