"""Serving GDN in pure JAX: vectorised decode lanes + a loop over prefill tiles.

One call, any batch composition, shapes from (tokens T, max requests R)
only; no `lax.cond` on the composition, so nothing recompiles when it changes.

1. Decode lanes (requests below decode_end), `decode_tile` per step of a
   `fori_loop` over the decode requests present: each lane gathers its read
   slot's states (or zeros) and its s + 1 = window tokens (masked past its
   length), runs the conv over [conv state; tokens] and then the one-token
   GDN step window times, vectorised over the lanes; the state after each of
   its tokens goes to slot state_indices[r] + j (one-slot in-place updates,
   skipped where nothing is written). No chunk padding.
2. Prefill tiles (the other valid requests): each request is cut into tiles
   of L = `tile_size` tokens; a `fori_loop` with a data-dependent trip count
   (the number of tiles the batch has, at most ceil(T / L) + R) runs one tile
   per step: the conv over [carried window; tile] and the chunked WY/UT
   algebra of `gated_delta_rule/xla_chunked_kernel.py` (its
   `forward_from_state`, chunks of `chunk_size`) from the carried state. The first tile of a
   request loads its read slot's states, the last one stores the final
   states into its slot (one-slot dynamic updates of the pools carried by the
   loop, so in place). Tokens past the request's end in its last tile are
   masked (k = 0, beta = 0, g = 0: the state passes through; selects, so a
   NaN in the next request's tokens cannot leak in); their outputs are
   overwritten by the next tile or zeroed by `base._fwd`.

Cost therefore follows the batch: decode work is the decode requests present
(rounded up to `decode_tile`) x window steps; prefill work is the tiles
present, padded to L per request.
"""

import dataclasses
import itertools
from typing import Any, ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic
from typing_extensions import override

from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import prologue as gdn_prologue
from tokamax_gdn.ops.gated_delta_rule import xla_chunked_kernel as kernel

_F32 = jnp.float32
TileSize = Literal[64, 128, 256, 512, 1024]
ChunkSize = Literal[16, 32, 64]
DecodeTile = Literal[1, 2, 4, 8, 16, 32, 64]


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the prefill path.

  tile_size: tokens per loop step (one request's tile); a multiple of
    chunk_size. Larger tiles batch more chunks per step but pad each
    request's last tile further.
  chunk_size: tokens per chunk of the WY/UT algebra inside a tile.
  decode_tile: decode requests per loop step of the decode path.
  """

  tile_size: TileSize = 256
  chunk_size: ChunkSize = 64
  decode_tile: DecodeTile = 8

  def __post_init__(self):
    if self.tile_size % self.chunk_size:
      raise ValueError(f"tile_size={self.tile_size} is not a multiple of"
                       f" chunk_size={self.chunk_size}.")


def heuristic_config(num_tokens: int) -> Config:
  """Prefill: C=64 in tiles of 256 tokens; tiles of 64 (C=32) for batches of
  at most 64 tokens, where a larger tile would be padding. Decode: 8 lanes
  per step (their f32 states stay in cache on CPU)."""
  if num_tokens <= 64:
    return Config(tile_size=64, chunk_size=32, decode_tile=8)
  return Config(tile_size=256, chunk_size=64, decode_tile=8)


def _autotuning_configs(num_tokens: int) -> set[Config]:
  """(tile, chunk) pairs with tiles no longer than the batch needs, at the
  heuristic decode tile; decode tiles at the heuristic prefill tiling."""
  best = heuristic_config(num_tokens)
  configs = {best}
  for tile, chunk in itertools.product((64, 128, 256, 512, 1024), (16, 32, 64)):
    if tile % chunk == 0 and tile // 2 < max(num_tokens, 64):
      configs.add(Config(tile_size=tile, chunk_size=chunk, decode_tile=best.decode_tile))
  for lanes in (1, 2, 4, 8, 16, 32, 64):
    configs.add(Config(tile_size=best.tile_size, chunk_size=best.chunk_size, decode_tile=lanes))
  return configs


def _conv(xp: jax.Array, taps: jax.Array, bias: jax.Array, n: int) -> jax.Array:
  """silu(bias + sum_w taps[w] * xp[..., w : w + n, :]) for xp [..., n + W - 1, D]."""
  pre = bias
  for w in range(taps.shape[0]):
    pre = pre + taps[w] * xp[..., w:w + n, :]
  return jax.nn.silu(pre)


def _qk(x: jax.Array) -> jax.Array:
  return gdn_prologue.l2norm(x)


def _put(pool, slot, value, write):
  """pool with `value` at `slot` where `write` (else its old value): one slot."""
  old = jax.lax.dynamic_index_in_dim(pool, slot, keepdims=False)
  new = jnp.where(write, value.astype(pool.dtype), old)
  return jax.lax.dynamic_update_index_in_dim(pool, new, slot, axis=0)


def _decode_tiles(qkv, beta_all, g_all, conv_pool, rec_pool, out, reqs: base.Requests,
                  taps, bias, dims: base.Dims, config: "Config"):
  """Step 1 of the module doc: the decode requests, `decode_tile` lanes per
  loop step (as many steps as the batch has decode tiles)."""
  t_len = qkv.shape[0]
  n_req = reqs.start.shape[0]
  lanes, window = config.decode_tile, reqs.window
  hk, grp = dims.n_kq, dims.n_v // dims.n_kq
  idx = jnp.arange(n_req, dtype=jnp.int32)
  num_tiles = -(-jnp.max(jnp.where(reqs.decode, idx + 1, 0)) // lanes)
  pos = jnp.arange(window)

  def body(p, carry):
    conv_pool, rec_pool, out = carry
    r = jnp.minimum(p * lanes + jnp.arange(lanes), n_req - 1)               # [lanes]
    decode = reqs.decode[r] & (p * lanes + jnp.arange(lanes) < n_req)
    tok = jnp.clip(reqs.start[r, None] + pos[None, :], 0, t_len - 1)       # [lanes, w]
    live = decode[:, None] & (pos[None, :] < reqs.length[r, None])
    init = decode & reqs.has_init[r]
    read = reqs.read_slot[r]
    conv0 = jnp.where(init[:, None, None], conv_pool[read].astype(_F32), 0.0)
    s = jnp.where(init[:, None, None, None], rec_pool[read].astype(_F32), 0.0)
    x = jnp.where(live[..., None], qkv[tok].astype(_F32), 0.0)             # [lanes, w, D]
    xp = jnp.concatenate([conv0, x], axis=1)                               # [lanes, W-1+w, D]
    q, k, v = base.split_heads(_conv(xp, taps, bias, window), dims)
    q, k = _qk(q), _qk(k)                                                  # [lanes, w, Hk, K]
    v = v.reshape(lanes, window, hk, grp, dims.d_v)
    beta = beta_all[tok].reshape(lanes, window, hk, grp)
    decay = jnp.exp(g_all[tok]).reshape(lanes, window, hk, grp)
    s = s.reshape(lanes, hk, grp, dims.d_k, dims.d_v)
    # Matrix-vector products as broadcast multiply + reduce: XLA fuses each
    # into one pass over the states (as batched dots, CPU lowers them to
    # per-lane transposes and small GEMVs, several times slower).
    states, outs = [], []
    for j in range(window):
      k_j = k[:, j, :, None, :, None]                                      # [lanes, Hk, 1, K, 1]
      s_new = decay[:, j, ..., None, None] * s
      pred = jnp.sum(k_j * s_new, axis=-2)                                 # [lanes, Hk, G, V]
      delta = beta[:, j, ..., None] * (v[:, j] - pred)
      s_new = s_new + k_j * delta[..., None, :]
      outs.append(dims.scale * jnp.sum(q[:, j, :, None, :, None] * s_new, axis=-2))
      # No select: positions past a lane's length (a suffix) write nothing
      # and their outputs are dropped.
      s = s_new
      states.append(s)
    # Checkpoint j (the state after token j) goes to state_indices[r] + j,
    # one slot at a time, only for the (lane, j) that have a token (loops
    # over the lanes and their lengths), so nothing is read back and no other
    # slot is rewritten (XLA:CPU's scatter is several times slower).
    n_ckpt = jnp.where(decode, jnp.minimum(reqs.length[r], window), 0)

    def store_lane(i, pools):
      def store(j, pools):
        conv_pool, rec_pool = pools
        slot = reqs.write_slot[r[i]] + j
        new_conv = jax.lax.dynamic_index_in_dim(
            jax.lax.dynamic_index_in_dim(conv_ckpt, i, keepdims=False), j, keepdims=False)
        new_rec = jax.lax.dynamic_index_in_dim(
            jax.lax.dynamic_index_in_dim(rec_ckpt, i, keepdims=False), j, keepdims=False)
        return (jax.lax.dynamic_update_index_in_dim(conv_pool, new_conv.astype(conv_pool.dtype),
                                                    slot, axis=0),
                jax.lax.dynamic_update_index_in_dim(rec_pool, new_rec.astype(rec_pool.dtype),
                                                    slot, axis=0))
      return jax.lax.fori_loop(0, n_ckpt[i], store, pools)

    rec_ckpt = (states[0][:, None] if window == 1 else jnp.stack(states, axis=1)).reshape(
        lanes, window, *rec_pool.shape[1:])
    conv_ckpt = jnp.stack([xp[:, j + 1:j + dims.kernel_size] for j in range(window)], axis=1)
    conv_pool, rec_pool = jax.lax.fori_loop(0, lanes, store_lane, (conv_pool, rec_pool))
    rows = jnp.where(live, tok, out.shape[0]).reshape(-1)
    o = jnp.stack(outs, axis=1).reshape(lanes * window, dims.n_v * dims.d_v)
    out = out.at[rows].set(o, mode="drop")
    return conv_pool, rec_pool, out

  return jax.lax.fori_loop(0, num_tiles, body, (conv_pool, rec_pool, out))


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
  # The chunked algebra's floor on log-decays (gated_delta_rule/prologue.py).
  g_p = pad(jnp.maximum(g_all, gdn_prologue.CHUNKED_LOG_DECAY_FLOOR))
  precision = kernel.matmul_precision(qkv.dtype)
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
    o, s_next = kernel.forward_from_state(
        q[None], k[None], v[None], g[None], beta[None], s, chunk_size=config.chunk_size,
        scale=dims.scale, precision=precision)
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
class XlaCausalConv1dGatedDeltaRule(config_hooks.ConfigHooks,
                                    base.CausalConv1dGatedDeltaRule[Config, Any]):
  """Decode lanes + prefill tiles in XLA (module doc)."""

  config_cls: ClassVar[type[Config]] = Config
  heuristics = config_hooks.of_size(heuristic_config, "qkv", 0)
  autotuning_configs = config_hooks.of_size(_autotuning_configs, "qkv", 0)

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
    conv_pool, rec_pool, out = _decode_tiles(qkv, beta_all, g_all, conv_state,
                                             recurrent_state, out, reqs, taps, bias, dims,
                                             config)
    conv_pool, rec_pool, out = _prefill_tiles(qkv, beta_all, g_all, conv_pool, rec_pool,
                                              out, reqs, taps, bias, dims, config)
    return (conv_pool, rec_pool), out[:t_len]


IMPLEMENTATION = XlaCausalConv1dGatedDeltaRule()
