"""Serving GDN in pure JAX: vectorised decode lanes + a loop over prefill tiles.

One call, any batch composition, shapes from (tokens T, max requests R)
only; no `lax.cond` on the composition, so nothing recompiles when it changes.

1. Decode lanes (requests below decode_end): lane r < min(R, T) gathers its
   read slot's states (or zeros), its s + 1 = window tokens (masked past its
   length), runs the conv over [conv state; tokens] and then the one-token
   GDN step window times, vectorised over lanes; the state after each of its
   tokens is scattered to slot state_indices[r] + j (`mode="drop"` for
   positions and lanes that write nothing). No chunk padding.
2. Prefill tiles (the other valid requests): each request is cut into tiles
   of L = `tile_size` tokens; a `fori_loop` with a data-dependent trip count
   (the number of tiles the batch has, at most ceil(T / L) + R) runs one tile
   per step: the conv over [carried window; tile] and the chunked WY/UT
   algebra of `gated_delta_rule/xla_chunked_kernel.py` (its `_forward_block`,
   chunks of `chunk_size`) from the carried state. The first tile of a
   request loads its read slot's states, the last one stores the final
   states into its slot (one-slot dynamic updates of the pools carried by the
   loop, so in place). Tokens past the request's end in its last tile are
   masked (k = 0, beta = 0, g = 0: the state passes through; selects, so a
   NaN in the next request's tokens cannot leak in); their outputs are
   overwritten by the next tile or zeroed by `base._fwd`.

Cost therefore follows the batch: decode work is R_lanes x window steps;
prefill work is the tiles actually present, padded to L per request.
"""

import dataclasses
import itertools
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op
from typing_extensions import override

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import prologue as gdn_prologue
from tokamax_gdn.ops.gated_delta_rule import xla_chunked_kernel as kernel

_F32 = jnp.float32
TileSize = Literal[64, 128, 256, 512, 1024]
ChunkSize = Literal[16, 32, 64]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the prefill path.

  tile_size: tokens per loop step (one request's tile); a multiple of
    chunk_size. Larger tiles batch more chunks per step but pad each
    request's last tile further.
  chunk_size: tokens per chunk of the WY/UT algebra inside a tile.
  """

  tile_size: TileSize = 256
  chunk_size: ChunkSize = 64

  def __post_init__(self):
    if self.tile_size % self.chunk_size:
      raise ValueError(f"tile_size={self.tile_size} is not a multiple of"
                       f" chunk_size={self.chunk_size}.")


def _heuristics(num_tokens: int) -> Config:
  """C=64 in tiles of 256 tokens; tiles of 64 (C=32) for batches of at most
  64 tokens, where a larger tile would be padding."""
  if num_tokens <= 64:
    return Config(tile_size=64, chunk_size=32)
  return Config(tile_size=256, chunk_size=64)


def _autotuning_configs(num_tokens: int) -> set[Config]:
  """Every (tile, chunk) pair with tiles no longer than the batch needs."""
  configs = {_heuristics(num_tokens)}
  for tile, chunk in itertools.product((64, 128, 256, 512, 1024), (16, 32, 64)):
    if tile % chunk == 0 and tile // 2 < max(num_tokens, 64):
      configs.add(Config(tile_size=tile, chunk_size=chunk))
  return configs


def _conv(xp: jax.Array, taps: jax.Array, bias: jax.Array, n: int) -> jax.Array:
  """silu(bias + sum_w taps[w] * xp[..., w : w + n, :]) for xp [..., n + W - 1, D]."""
  pre = bias
  for w in range(taps.shape[0]):
    pre = pre + taps[w] * xp[..., w:w + n, :]
  return jax.nn.silu(pre)


def _qk(x: jax.Array) -> jax.Array:
  return gdn_prologue.l2norm(x)


def _decode_lanes(qkv, beta_all, g_all, conv_pool, rec_pool, out, reqs: base.Requests,
                  taps, bias, dims: base.Dims):
  """Step 1 of the module doc: every decode request in one vectorised pass."""
  t_len = qkv.shape[0]
  lanes = min(reqs.start.shape[0], t_len)
  window = reqs.window
  hk, grp = dims.n_kq, dims.n_v // dims.n_kq
  num_slots = rec_pool.shape[0]
  decode = reqs.decode[:lanes]
  pos = jnp.arange(window)
  tok = jnp.clip(reqs.start[:lanes, None] + pos[None, :], 0, t_len - 1)        # [R', w]
  live = decode[:, None] & (pos[None, :] < reqs.length[:lanes, None])
  init = (decode & reqs.has_init[:lanes])
  read = reqs.read_slot[:lanes]
  conv0 = jnp.where(init[:, None, None], conv_pool[read].astype(_F32), 0.0)
  s = jnp.where(init[:, None, None, None], rec_pool[read].astype(_F32), 0.0)
  x = jnp.where(live[..., None], qkv[tok].astype(_F32), 0.0)                  # [R', w, D]
  xp = jnp.concatenate([conv0, x], axis=1)                                    # [R', W-1+w, D]
  q, k, v = base.split_heads(_conv(xp, taps, bias, window), dims)
  q, k = _qk(q), _qk(k)                                                       # [R', w, Hk, K]
  v = v.reshape(lanes, window, hk, grp, dims.d_v)
  beta = beta_all[tok].reshape(lanes, window, hk, grp)
  decay = jnp.exp(g_all[tok]).reshape(lanes, window, hk, grp)
  s = s.reshape(lanes, hk, grp, dims.d_k, dims.d_v)
  hi = jax.lax.Precision.HIGHEST
  states, outs = [], []
  for j in range(window):
    s_new = decay[:, j, ..., None, None] * s
    pred = jnp.einsum("rhk,rhgkv->rhgv", k[:, j], s_new, precision=hi)
    delta = beta[:, j, ..., None] * (v[:, j] - pred)
    s_new = s_new + jnp.einsum("rhk,rhgv->rhgkv", k[:, j], delta, precision=hi)
    outs.append(dims.scale * jnp.einsum("rhgkv,rhk->rhgv", s_new, q[:, j], precision=hi))
    s = jnp.where(live[:, j, None, None, None, None], s_new, s)
    states.append(s)
  # Checkpoint j: the state after token j, at state_indices[r] + j (nothing
  # is written where `live` is False: the index is out of range, dropped).
  slot = jnp.where(live, reqs.write_slot[:lanes, None] + pos[None, :], num_slots).reshape(-1)
  rec_ckpt = jnp.stack(states, axis=1).reshape(lanes * window, dims.n_v, dims.d_k, dims.d_v)
  conv_ckpt = jnp.stack([xp[:, j + 1:j + dims.kernel_size] for j in range(window)], axis=1)
  conv_ckpt = conv_ckpt.reshape(lanes * window, dims.kernel_size - 1, dims.dim)
  rec_pool = rec_pool.at[slot].set(rec_ckpt.astype(rec_pool.dtype), mode="drop")
  conv_pool = conv_pool.at[slot].set(conv_ckpt.astype(conv_pool.dtype), mode="drop")
  rows = jnp.where(live, tok, out.shape[0]).reshape(-1)
  o = jnp.stack(outs, axis=1).reshape(lanes * window, dims.n_v * dims.d_v)
  out = out.at[rows].set(o, mode="drop")
  return conv_pool, rec_pool, out


def _put(pool, slot, value, write):
  """pool with `value` at `slot` where `write` (else its old value): one slot."""
  old = jax.lax.dynamic_index_in_dim(pool, slot, keepdims=False)
  new = jnp.where(write, value.astype(pool.dtype), old)
  return jax.lax.dynamic_update_index_in_dim(pool, new, slot, axis=0)


def _prefill_tiles(qkv, beta_all, g_all, conv_pool, rec_pool, out, reqs: base.Requests,
                   taps, bias, dims: base.Dims, config: Config):
  """Step 2 of the module doc: the non-decode requests, one tile per loop step."""
  t_len, dim = qkv.shape
  n_req = reqs.start.shape[0]
  tile, width = config.tile_size, dims.kernel_size
  hk, grp = dims.n_kq, dims.n_v // dims.n_kq
  lengths = jnp.where(reqs.valid & ~reqs.decode, reqs.length, 0)
  tiles = -(-lengths // tile)                                             # [R]
  first_tile = jnp.cumsum(tiles) - tiles
  max_tiles = min(-(-t_len // tile) + n_req, t_len)
  tile_req = jnp.repeat(jnp.arange(n_req, dtype=jnp.int32), tiles,
                        total_repeat_length=max_tiles)
  pad = lambda x: jnp.pad(x, ((0, tile), (0, 0)))
  qkv_p, beta_p = pad(qkv), pad(beta_all)
  # The chunked algebra's floor on log-decays (gated_delta_rule/base.py).
  g_p = pad(jnp.maximum(g_all, gdn_prologue.CHUNKED_LOG_DECAY_FLOOR))
  precision = kernel._precision(qkv.dtype)  # pylint: disable=protected-access
  rows_idx = jnp.arange(tile)

  def body(p, carry):
    conv_pool, rec_pool, out, window, s = carry
    r = tile_req[p]
    t_id = p - first_tile[r]
    start = reqs.start[r] + t_id * tile
    size = jnp.minimum(reqs.start[r] + reqs.length[r] - start, tile)
    first, last = t_id == 0, t_id == tiles[r] - 1
    rows = (rows_idx < size)[:, None]
    read, init = reqs.read_slot[r], reqs.has_init[r]
    conv0 = jax.lax.dynamic_index_in_dim(conv_pool, read, keepdims=False).astype(_F32)
    s0 = jax.lax.dynamic_index_in_dim(rec_pool, read, keepdims=False).astype(_F32)
    window = jnp.where(first, jnp.where(init, conv0, 0.0), window)
    s = jnp.where(first, jnp.where(init, s0.reshape(s.shape), 0.0), s)

    x = jnp.where(rows, jax.lax.dynamic_slice_in_dim(qkv_p, start, tile).astype(_F32), 0.0)
    xp = jnp.concatenate([window, x], axis=0)                            # [L + W - 1, D]
    q, k, v = base.split_heads(_conv(xp, taps, bias, tile), dims)
    q = _qk(q)
    k = jnp.where(rows[..., None], _qk(k), 0.0)
    beta = jnp.where(rows, jax.lax.dynamic_slice_in_dim(beta_p, start, tile), 0.0)
    g = jnp.where(rows, jax.lax.dynamic_slice_in_dim(g_p, start, tile), 0.0)
    o, (s_next, _) = kernel._forward_block(  # pylint: disable=protected-access
        q[None], k[None], v[None], g[None], beta[None], None, None, (s, None), None,
        c=config.chunk_size, scale=dims.scale, precision=precision)
    out = jax.lax.dynamic_update_slice_in_dim(out, o.reshape(tile, -1), start, axis=0)
    window_next = jax.lax.dynamic_slice_in_dim(xp, size, width - 1)
    slot = reqs.write_slot[r]
    conv_pool = _put(conv_pool, slot, window_next, last)
    rec_pool = _put(rec_pool, slot, s_next.reshape(rec_pool.shape[1:]), last)
    return conv_pool, rec_pool, out, window_next, s_next

  carry = (conv_pool, rec_pool, out, jnp.zeros((width - 1, dim), _F32),
           jnp.zeros((1, hk, grp, dims.d_k, dims.d_v), _F32))
  conv_pool, rec_pool, out, _, _ = jax.lax.fori_loop(0, jnp.sum(tiles), body, carry)
  return conv_pool, rec_pool, out


@dataclasses.dataclass(frozen=True)
class XlaCausalConv1dGatedDeltaRule(base.CausalConv1dGatedDeltaRule[Config, Any]):
  """Decode lanes + prefill tiles in XLA (module doc)."""

  config_cls: ClassVar[type[Config]] = Config

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    return _heuristics(ba.arguments["qkv"].shape[0])

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    return _autotuning_configs(ba.arguments["qkv"].shape[0])

  @override
  def _serve(self, qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
             dt_bias, reqs, *, dims, config):
    t_len = qkv.shape[0]
    if t_len == 0:
      return (conv_state, recurrent_state), jnp.zeros((0, dims.n_v * dims.d_v), qkv.dtype)
    taps = base.conv_weight_taps(conv_weight)
    bias = (jnp.zeros((dims.dim,), _F32) if conv_bias is None
            else conv_bias.astype(_F32))
    beta_all, g_all = base.gates(b, a, a_log, dt_bias)
    out = jnp.zeros((t_len + config.tile_size, dims.n_v * dims.d_v), _F32)
    conv_pool, rec_pool, out = _decode_lanes(qkv, beta_all, g_all, conv_state,
                                             recurrent_state, out, reqs, taps, bias, dims)
    conv_pool, rec_pool, out = _prefill_tiles(qkv, beta_all, g_all, conv_pool, rec_pool,
                                              out, reqs, taps, bias, dims, config)
    return (conv_pool, rec_pool), out[:t_len]


IMPLEMENTATION = XlaCausalConv1dGatedDeltaRule()
