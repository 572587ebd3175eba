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
back-substitution by matmul. The state recurrence over chunks is a float32
`lax.scan` that only carries s; everything else is batched over all chunks.
T is padded internally to a multiple of C (beta = 0, g = 0, k = 0 on the tail).
GVA: k-side products are computed once per key head, value heads are laid out
as [Hk, group] and broadcast.

Backward (reverse scan over chunks carrying ds = dL/ds_next):
  d_delta  = p^T dout + dec * (k ds)
  ds_prev  = scale q^T (e_g * dout) + e_gc ds - w^T d_delta
then, batched over chunks: dp = dout delta^T, dw = -d_delta s^T, du = d_delta,
d(beta e_g k) = t^T dw, d(beta v) = t^T du, da = -(t^T dw w^T + t^T du u^T)
restricted to the strict lower part (the gradient of t = (I + a)^{-1} without
forming dt), and the log-decay gradient per token from e_g, gamma (row sums
minus column sums of dp*p + da*a), dec and e_gc, followed by a reverse cumsum
within the chunk to undo gcum.

Saved vs recomputed: the op's own residuals are `None`, i.e. 0 bytes per token
per head; tokamax keeps the inputs and the outputs for every op anyway (for
`out` that is V * itemsize bytes per token per head, 512 B at V = 128 f32).
The backward recomputes a, t, w, u and the chunk-entry states (one extra
forward state scan, O(N K V) temporaries) instead of keeping the states
(K V 4 / C bytes per token per head, 1 KiB at K = V = 128, C = 64).
"""

import dataclasses
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op
from typing_extensions import override

from tokamax_gdn.ops.gated_delta_rule import base

_F32 = jnp.float32
_SUB_BLOCK = 16


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Chunk length of the WY/UT decomposition (tokens per chunk)."""

  chunk_size: Literal[16, 32, 64, 128] = 64


def _heuristics(t: int) -> Config:
  for c in (16, 32):
    if t <= c:
      return Config(chunk_size=c)
  return Config(chunk_size=64)


def _autotuning_configs() -> set[Config]:
  return {Config(chunk_size=c) for c in (16, 32, 64, 128)}


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
  """Pads, chunks and computes everything that does not depend on the state."""
  _, t_len, hk, _ = q.shape
  tp = -(-t_len // c) * c
  pad = lambda x: _pad_time(x, tp)
  qc = _key_side(pad(q), c)
  kc = _key_side(pad(k), c)
  vc = _value_side(pad(v).astype(_F32), c, hk)
  gc = _gate_side(pad(log_decay.astype(_F32)), c, hk)
  bc = _gate_side(pad(beta.astype(_F32)), c, hk)
  gcum = jnp.cumsum(gc, axis=-1)
  causal = jnp.tril(jnp.ones((c, c), bool))
  if starts is None:
    mask = jnp.broadcast_to(causal, (1, 1, 1, 1, c, c))
    first = last = jnp.ones((1, 1, 1, 1, c), bool)
  else:
    seg = jnp.cumsum(_to_chunks(pad(starts).astype(jnp.int32), c), axis=-1)
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


def chunked_forward(q, k, v, log_decay, beta, *, scale, initial_state,
                    segment_ids, chunk_size):
  """Chunked forward: (out [B, T, Hv, V] f32, final_state [B, Hv, K, V] f32)."""
  b, t_len, hk, dk = q.shape
  hv, dv = v.shape[2:]
  precision = _precision(q.dtype)
  starts = base.segment_starts(segment_ids, t_len)
  ch = _prepare(q, k, v, log_decay, beta, starts, c=chunk_size, scale=scale,
                precision=precision)
  s0 = _initial(initial_state, b, hk, hv // hk, dk, dv)
  entries, delta, final = _entry_states(ch, s0, precision)
  inter = jnp.einsum("nbhck,nbhgkv->nbhgcv", ch.q, entries, precision=precision,
                     preferred_element_type=_F32)
  out = scale * ch.e_g[..., None] * inter + jnp.matmul(
      ch.p, delta, precision=precision)
  out = _value_side_back(out)[:, :t_len]
  return out, final.reshape(b, hv, dk, dv)


def chunked_backward(q, k, v, log_decay, beta, d_out, d_final, *, scale,
                     initial_state, segment_ids, chunk_size):
  """Analytical VJP of `chunked_forward` (see the module docstring)."""
  b, t_len, hk, d_key = q.shape
  hv, d_val = v.shape[2:]
  grp = hv // hk
  precision = _precision(q.dtype)
  mm = lambda x, y: jnp.matmul(x, y, precision=precision)
  ein = lambda s, *xs: jnp.einsum(s, *xs, precision=precision,
                                  preferred_element_type=_F32)
  starts = base.segment_starts(segment_ids, t_len)
  c = chunk_size
  ch = _prepare(q, k, v, log_decay, beta, starts, c=c, scale=scale,
                precision=precision)
  s0 = _initial(initial_state, b, hk, grp, d_key, d_val)
  entries, delta, _ = _entry_states(ch, s0, precision)

  tp = ch.q.shape[0] * c
  do = _value_side(_pad_time(d_out.astype(_F32), tp), c, hk)
  ds_final = (jnp.zeros_like(s0) if d_final is None
              else d_final.astype(_F32).reshape(s0.shape))
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

  return (
      _key_side_back(dq)[:, :t_len],
      _key_side_back(dk)[:, :t_len],
      _value_side_back(dv_)[:, :t_len],
      _gate_side_back(d_g)[:, :t_len],
      _gate_side_back(d_beta)[:, :t_len],
      d_s0.reshape(b, hv, d_key, d_val),
  )


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
    del ba
    return _autotuning_configs()

  @override
  def _core_fwd(self, q, k, v, log_decay, beta, *, scale, initial_state,
                segment_ids, config):
    out, final = chunked_forward(
        q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=config.chunk_size)
    return out, final, None


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaGatedDeltaRuleVjp(base.GatedDeltaRuleVjp[Config, Any]):
  """Analytical backward of `XlaGatedDeltaRule` (recomputes, saves nothing)."""

  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = base.CHUNKED_LOG_DECAY_FLOOR

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    return _heuristics(ba.arguments["query"].shape[1])

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    del ba
    return _autotuning_configs()

  @override
  def _core_bwd(self, residuals, q, k, v, log_decay, beta, d_out, d_final, *,
                scale, initial_state, segment_ids, config):
    del residuals
    return chunked_backward(
        q, k, v, log_decay, beta, d_out, d_final, scale=scale,
        initial_state=initial_state, segment_ids=segment_ids,
        chunk_size=config.chunk_size)


IMPLEMENTATION = XlaGatedDeltaRule()
