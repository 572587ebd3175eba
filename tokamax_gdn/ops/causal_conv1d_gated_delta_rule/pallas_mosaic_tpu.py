"""Pallas Mosaic TPU serving GDN: Op wrapper (config, heuristics, VMEM, routing).

Every valid request runs in exactly one of two paths, chosen per request from
its length inside the call (no `lax.cond` on the batch composition: both
paths are in the program whenever the shapes allow them, so nothing
recompiles when the composition changes):

1. The decode kernel (`pallas_mosaic_tpu_decode*.py`): decode requests (one
   token, or a verify window of up to num_spec_tokens + 1) and every other
   request shorter than `min_chunked_tokens`. Its states move by DMA between
   the pools (aliased in place) and VMEM; conv window and GDN step fused.
   Tokens past the first `window` of a short prefill run one by one (row
   DMAs): correct, but ~a state pass per token, so `min_chunked_tokens`
   trades that against the chunked path's padding (below).
2. The chunked path, requests of at least `min_chunked_tokens` tokens (so at
   most N = tokens // min_chunked_tokens of them, a static bound): our
   `causal_conv1d` Pallas op over the packed tokens, with its SiLU and no
   segment ids, then each request's first W-1 rows (whose windows reach
   into the tokens before it) recomputed from its conv state and written in
   place; then `gdn_fwd_requests` (`gated_delta_rule/pallas_mosaic_tpu_kernel`)
   on the conv output as it is: a grid of work items, one per C-token block
   and chunked request touching it (at most T/C + N - 1), each running its
   request's rows of the block from the request's read slot (DMA'd from the
   pool) and writing its rows of the output (updating the decode kernel's
   output in place) and its final state (into the pool, in place). Tokens
   of other requests count as beta 0 and log-decay 0 there, so a NaN there
   cannot reach a chunked request. Items past the chunked requests' blocks
   skip their body and fetch nothing: a decode batch whose T allows chunked
   requests (tp8_decode_512) pays for their empty steps only. libtpu's
   estimator aborts on the kernel as it runs (block indices from SMEM), so
   `tokamax-gdn aot` estimates it through its cost model (`full_chunk_cost`,
   one item per block). Calls with a long qkv keep their arrays in HBM
   (`_HBM_TOKEN_BYTES`).

When T < min_chunked_tokens (every decode batch with the heuristic) the
chunked path is not compiled at all.

On a chip the kernels' head blocks are whole rows of 128 lanes. Heads whose
d_k or d_v is not a multiple of 128 run zero-padded to the next multiple
(`_lane_dims`): the call pads the activations, weights and both pools, and
slices the results back. Zero rows and columns of q, k, v and the state stay
zero through the conv, the L2 norms and the delta rule, and the query scale
stays the caller's d_k^-1/2, so the results are the unpadded ones; but both
pools are copied twice a call, so such heads cost far more than 128-lane
ones (every Qwen3-Next / Qwen3.5 layout has d_k = d_v = 128).
"""

import contextlib
import dataclasses
import functools
from typing import Annotated, ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops.causal_conv1d import pallas_mosaic_tpu as conv_pallas
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import base
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu_decode as decode_call
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu_decode_static as decode_static
from tokamax_gdn.ops.gated_delta_rule import prologue as gdn_prologue
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as gdn_common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_requests as gdn_requests
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_vmem as gdn_vmem
from tokamax_gdn.ops.tiling import round_up

_F32 = jnp.float32
_MIB = 1 << 20
_all_run: bool | None = None   # None: the real kernel; else full_decode_cost's has_init
_chunk_cost: bool | None = None   # None: the real kernel; else full_chunk_cost's run
_skip_idle = True   # `DecodeStatic.skip_idle` (off only to test that it changes no result)


@contextlib.contextmanager
def full_decode_cost(has_init: bool = True):
  """Compiles the decode kernel as if every request ran one token, or its
  whole verify window with every checkpoint written back
  (`DecodeStatic.all_run`), from a read state if `has_init` (else from
  zeros, no read DMA): for static cycle estimates only.

  libtpu's estimate leaves out the bodies of data-dependent branches, which
  is where the kernel's state DMAs sit; this variant has none, so its
  estimate is the cost of a full decode batch whose requests all continue
  (`has_init`) or all start fresh. Its results are meaningless (it ignores
  the request metadata).
  """
  global _all_run
  old, _all_run = _all_run, bool(has_init)
  try:
    yield
  finally:
    _all_run = old


@contextlib.contextmanager
def full_chunk_cost(run: bool):
  """Compiles the chunked path's GDN kernel (`gdn_fwd_requests`) at static
  block indices, one running item per block if `run`, else every item
  skipped: for static cycle estimates only (results meaningless).

  libtpu's estimator aborts on the real kernel, whose block indices come
  from SMEM ("No DMA issue node found for sync flag", v6e and tpu7x; the
  same kernel at static indices is estimated). With `run` the estimate is
  that of a call whose chunked requests cover the token blocks with one
  item each (a prefill, or a prefill after decodes; requests that share a
  block add an item each on the chip), else that of one whose requests
  hold no chunked token (a decode batch: every item moves its blocks, at
  least the real kernel's traffic).
  """
  global _chunk_cost
  old, _chunk_cost = _chunk_cost, bool(run)
  try:
    yield
  finally:
    _chunk_cost = old


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the two paths.

  decode_tile: requests per grid step of the decode kernel (their states are
    in VMEM together: in and `window` checkpoints each). A multiple of 8, or
    1, 2 or 4 for speculative windows (the kernel's blocks are tile x window
    token rows, a multiple of 8): a smaller tile is doubled until they are.
  chunk_size: C of the chunked GDN kernel.
  min_chunked_tokens: requests at least this long take the chunked path (see
    the module doc); shorter ones the decode kernel.
  decode_rolled: requests per iteration of the decode kernel's fori_loop over
    a tile (a divisor of decode_tile); 0 traces every request of the tile
    (lower and compile time grow with the tile). See
    `pallas_mosaic_tpu_decode_static.DecodeStatic.rolled`.
  """

  decode_tile: Annotated[int, pydantic.Field(gt=0)] = 16
  chunk_size: Literal[64, 128] = 128
  min_chunked_tokens: Annotated[int, pydantic.Field(ge=2)] = 128
  decode_rolled: Literal[0, 1, 2, 4, 8] = 2

  def __post_init__(self):
    if self.decode_tile % 8 and self.decode_tile not in _SMALL_TILES:
      raise ValueError(f"decode_tile must be a multiple of 8 or one of {_SMALL_TILES};"
                       f" got {self.decode_tile}")


# Tiles below 8 requests: for windows whose states do not fit 8 at a time.
_SMALL_TILES = (1, 2, 4)


def _row_tile(tile: int, window: int) -> int:
  """The tile the kernel runs: `tile`, doubled until tile x window token rows
  are a multiple of 8 (its blocks' sublanes)."""
  while (tile * window) % 8:
    tile *= 2
  return tile


def _whole_tiles(tiles, window: int) -> list[int]:
  """Those of `tiles` the kernel runs as they are (`_row_tile`)."""
  return [t for t in tiles if _row_tile(t, window) == t]


def _heuristics(ba: op.BoundArguments) -> Config:
  """Decode tiles of 8 requests, stepped 2 at a time in a loop, C = 128,
  and the chunked path from C tokens on. Where 8 requests' states and window
  checkpoints take more than 3/4 of the VMEM cap (32 or 64 value heads with
  a speculative window), the largest smaller tile under it that keeps the
  kernel's blocks whole (tile x window a multiple of 8): the estimate's
  margins were fitted at small states, and with 2 MiB states a grid step's
  fixed cost is nothing beside its DMAs.

  On the v5e chip a tile of 8 was faster than one of 32 at every TP8 decode
  spec (measured with the unrolled kernel, `decode_rolled=0`, whose compile
  time grows with the tile; the rolled one's does not); `tokamax-gdn bench`
  on a TPU re-measures it, and autotuning explores 16 to 64 (libtpu's v6e
  estimate favoured the larger tiles).

  C = 128 where the chunked kernel's VMEM estimate at it is within the cap
  (every named spec in bf16, 64 value heads included: 42.9 of 53 MiB on
  v5e / v6e), else 64 (64 value heads with float32 activations: 66.9 MiB
  at C = 128, 37.8 at 64).
  """
  args = ba.arguments
  window = args["num_spec_tokens"] + 1
  tiles = _whole_tiles((8, 4, 2, 1), window)
  need = {t: _decode_vmem(args, t, window) for t in tiles}
  cap = _vmem_cap()
  tile = next((t for t in tiles if need[t] <= cap * 3 // 4),
              next((t for t in tiles if need[t] <= cap), 8))
  chunk = next((c for c in (128, 64) if _chunk_vmem(args, c) <= cap), 128)
  return Config(decode_tile=tile, chunk_size=chunk, min_chunked_tokens=128, decode_rolled=2)


def _autotuning_configs(ba: op.BoundArguments) -> set[Config]:
  args = ba.arguments
  window = args["num_spec_tokens"] + 1
  out = {_heuristics(ba)}
  for tile in _whole_tiles((*_SMALL_TILES, 8, 16, 32, 64), window):
    if _decode_vmem(args, tile, window) > _vmem_cap():
      continue
    for chunk in (64, 128):
      if _chunk_vmem(args, chunk) > _vmem_cap():
        continue
      for min_tokens in (chunk, 4 * chunk):
        out.add(Config(decode_tile=tile, chunk_size=chunk, min_chunked_tokens=min_tokens))
  return out


_LANES = 128
# Pads short heads off the chip too (interpret mode): tests of the padded path.
_PAD_OFF_CHIP = False


def _lane_dims(dims: base.Dims) -> base.Dims:
  """The sizes the kernels run: on a chip (or off it with `_PAD_OFF_CHIP`)
  d_k and d_v rounded up to whole 128-lane rows, the query scale kept."""
  if not (dims.d_k % _LANES or dims.d_v % _LANES) or not (
      _PAD_OFF_CHIP or gdn_config.on_tpu()):
    return dims
  return dataclasses.replace(dims, d_k=round_up(dims.d_k, _LANES),
                             d_v=round_up(dims.d_v, _LANES), scale_d_k=dims.d_k)


def _args_dims(args) -> base.Dims:
  """The kernels' sizes (`_lane_dims`) of a call's bound arguments."""
  return _lane_dims(base.Dims(args["n_kq"], args["n_v"], args["d_k"], args["d_v"],
                              args["kernel_size"]))


def _pad_channels(x: jax.Array, dims: base.Dims, lanes: base.Dims, axis: int = -1):
  """`x` with its channel axis (q | k | v heads of `dims`) in `lanes`' sizes,
  each head zero-padded."""
  x = jnp.moveaxis(x, axis, -1)
  lead = x.shape[:-1]
  parts = [jnp.pad(h, [(0, 0)] * (h.ndim - 1) + [(0, dp - h.shape[-1])]).reshape(*lead, -1)
           for h, dp in zip(base.split_heads(x, dims), (lanes.d_k, lanes.d_k, lanes.d_v))]
  return jnp.moveaxis(jnp.concatenate(parts, axis=-1), -1, axis)


def _unpad_channels(x: jax.Array, dims: base.Dims, lanes: base.Dims):
  """`_pad_channels`' inverse on the last axis."""
  lead = x.shape[:-1]
  parts = [h[..., :d].reshape(*lead, -1)
           for h, d in zip(base.split_heads(x, lanes), (dims.d_k, dims.d_k, dims.d_v))]
  return jnp.concatenate(parts, axis=-1)


def _vmem_cap() -> int:
  return gdn_vmem.vmem_cap(gdn_config.target_generation())


def _requests_vmem(dims: base.Dims, chunk: int, act_dtype, pool_dtype) -> int:
  """The chunked path's GDN kernel (`gdn_fwd_requests`): its scoped VMEM
  estimate (`pallas_mosaic_tpu_vmem.requests_vmem_estimate`)."""
  return gdn_vmem.requests_vmem_estimate(
      chunk=chunk, hv=dims.n_v, hk=dims.n_kq, dim_k=dims.d_k, dim_v=dims.d_v,
      itemsize=jnp.dtype(act_dtype).itemsize, pool_itemsize=jnp.dtype(pool_dtype).itemsize)


def _chunk_vmem(args, chunk: int) -> int:
  """`_requests_vmem` of a call's bound arguments at chunk size `chunk`."""
  return _requests_vmem(_args_dims(args), chunk, args["qkv"].dtype,
                        args["recurrent_state"].dtype)


# Direct mode keeps the whole output in VMEM up to this size (one buffer).
_RESIDENT_OUT_BYTES = 1 << 20


def _decode_static(dims: base.Dims, window: int, tile: int, mid: bool, *, num_requests: int,
                   num_tokens: int, act_itemsize: int, num_slots: int = 1, min_chunked: int = 0,
                   has_bias: bool = True, has_reads: bool = False, has_offsets: bool = False,
                   rolled: int = 0) -> decode_static.DecodeStatic:
  direct = mid and window == 1
  blk = decode_static.BLOCK_ROWS
  tile = min(_row_tile(tile, window), round_up(num_requests, 8))
  r_pad = round_up(num_requests, tile)
  rows = max(round_up(num_tokens, blk), r_pad)
  resident = (direct and rows * dims.n_v * dims.d_v * act_itemsize <= _RESIDENT_OUT_BYTES
              and (tile % blk == 0 or tile == r_pad))
  return decode_static.DecodeStatic(n_kq=dims.n_kq, n_v=dims.n_v, d_k=dims.d_k, d_v=dims.d_v,
                                    kernel_size=dims.kernel_size, window=window, tile=tile,
                                    mid_tokens=mid, direct=direct,
                                    resident_rows=rows if resident else 0, num_tokens=num_tokens,
                                    num_requests=num_requests, num_slots=num_slots,
                                    min_chunked=min_chunked, has_bias=has_bias,
                                    has_reads=has_reads, has_offsets=has_offsets,
                                    all_run=_all_run is not None,
                                    all_init=_all_run is not False,
                                    v5e_forms=gdn_common.v5e_forms(),
                                    scale_d_k=dims.scale_d_k,
                                    skip_idle=_skip_idle,
                                    rolled=rolled if tile % max(rolled, 1) == 0 else 0)


def _decode_vmem(args, tile: int, window: int) -> int:
  rec = args["recurrent_state"]
  dims = _args_dims(args)
  qkv = args["qkv"]
  act = jnp.dtype(qkv.dtype).itemsize
  st = _decode_static(dims, window, tile, True, num_requests=args["state_indices"].shape[0],
                      num_tokens=qkv.shape[0], act_itemsize=act)
  return decode_static.vmem_bytes(st, jnp.dtype(rec.dtype).itemsize, act)


def _decode_path(qkv, b, a, conv_pool, rec_pool, conv_weight, conv_bias, a_log, dt_bias,
                 reqs: base.Requests, runs: jax.Array, min_chunked: int, dims: base.Dims,
                 cfg: Config, mid: bool, interpret: bool):
  """The decode kernel over the requests where `runs` (valid ones, less the
  chunked path's: non-decodes of at least `min_chunked` tokens, 0 for none);
  returns (out [T, Hv V] with their tokens' rows, zeros elsewhere,
  conv_pool, rec_pool).

  With one-token decodes (`direct`) the kernel reads the index arrays, the
  token arrays and the weights as passed, and `out` is its output (kept in
  VMEM up to _RESIDENT_OUT_BYTES) or the sum of its two outputs: no XLA op
  builds metadata or converts an operand (each such op costs ~0.6-1.8 k
  cycles on the v6e estimate, more than its work)."""
  t_len = qkv.shape[0]
  n_req, window = reqs.start.shape[0], reqs.window
  index = jax.tree.leaves(reqs.index)   # field order, the absent ones (None) left out
  st = _decode_static(dims, window, cfg.decode_tile, mid, num_requests=n_req, num_tokens=t_len,
                      act_itemsize=jnp.dtype(qkv.dtype).itemsize,
                      num_slots=rec_pool.shape[0], min_chunked=min_chunked,
                      has_bias=conv_bias is not None,
                      has_reads=reqs.index.read_state_indices is not None,
                      has_offsets=reqs.index.read_offsets is not None,
                      rolled=cfg.decode_rolled)
  need = decode_static.vmem_bytes(st, jnp.dtype(rec_pool.dtype).itemsize,
                                  jnp.dtype(qkv.dtype).itemsize)
  # The estimate is an upper bound (its margins); a need past the cap that
  # `check_vmem` accepts runs with the limit at what it accepts (64 value
  # heads: tile 8 estimates 53.2 MiB and compiled under a 53 MiB limit on the
  # chip).
  gdn_vmem.check_vmem(
      "causal_conv1d_gated_delta_rule", need, _vmem_cap(),
      f"a decode tile of {st.tile} requests (window {window}, {dims.n_v} value heads,"
      f" {rec_pool.dtype} pool {rec_pool.shape})")
  r_pad = decode_static.padded_requests(st)
  # [dim, 1, W] -> [W, dim]: XLA's TPU layout of the weight is already W-major
  # (a bitcast, no copy).
  taps = jnp.transpose(conv_weight[:, 0, :])
  bias = None if conv_bias is None else conv_bias[None]
  if st.direct:
    # The kernel's blocks are the token rows (request r's block row is token
    # r, as in a decode batch): no gathered copy of the activations.
    rows = (None, None, None)
  else:
    length = jnp.where(runs, reqs.length, 0)
    pos = jnp.arange(window)
    tok = jnp.clip(jnp.pad(reqs.start, (0, r_pad - n_req))[:, None] + pos[None, :],
                   0, t_len - 1).reshape(-1)
    rows = (qkv[tok], b[tok], a[tok])
  out_rows, out_mid, conv_pool, rec_pool = decode_call.decode(
      index, *rows, taps, bias, a_log[None], dt_bias[None], conv_pool, rec_pool,
      *((qkv, b, a) if mid else ()), st=st, interpret=interpret,
      vmem_limit_bytes=min(gdn_vmem.accepted_need(_vmem_cap()), need * 5 // 4))
  if st.resident_rows:
    out = out_rows if out_rows.shape[0] == t_len else out_rows[:t_len]
    return out, conv_pool, rec_pool
  if st.direct:
    # Each token row is non-zero in at most one of the two.
    home = out_rows[:t_len] if r_pad >= t_len else jnp.pad(out_rows, ((0, t_len - r_pad), (0, 0)))
    return home + out_mid, conv_pool, rec_pool
  # Token -> the kernel's output row (a row gather: XLA's row scatters cost
  # several times more on the estimate); `none` for tokens it did not run,
  # `mid` for tokens past a short request's window (they are in `out_mid`).
  # One compare of every token against every request's range (requests are
  # disjoint, so at most one matches): a single fusion, where scatters and a
  # cumsum were each an op of their own.
  k = jnp.arange(t_len, dtype=jnp.int32)[:, None] - reqs.start[None, :]          # [T, R]
  none, mid_row = r_pad * window, r_pad * window + 1
  in_win = (k >= 0) & (k < jnp.minimum(length, window)[None, :])
  row = jnp.sum(jnp.where(in_win, jnp.arange(n_req, dtype=jnp.int32)[None, :] * window + k, 0),
                axis=1)
  row_of = jnp.where(jnp.any(in_win, axis=1), row, none)
  if mid:
    in_mid = (k >= window) & (k < length[None, :])
    row_of = jnp.where(jnp.any(in_mid, axis=1), mid_row, row_of)
  out = jnp.take(out_rows, row_of, axis=0, mode="fill", fill_value=0)
  if mid:
    out = jnp.where((row_of == mid_row)[:, None], out_mid, out)
  return out, conv_pool, rec_pool


# Calls whose qkv exceeds this many bytes (a long prefill, such as tokamax's
# tp8_mixed_64_t8192) keep the chunked path's big arrays in HBM: the conv's x
# and y (`causal_conv1d`'s `Config.in_hbm`, at 512-token tiles) and
# `gdn_fwd_requests`' qkv and output. Otherwise XLA places them in VMEM as
# far as it goes and a long call's compile runs out of it; smaller calls keep
# XLA's placement, which was cheaper there. (The decode kernel's pools are in
# HBM at every size, see `pallas_mosaic_tpu_decode.decode`.)
_HBM_TOKEN_BYTES = 16 * _MIB
_HBM_CONV_BLOCK_T = 512


def _in_hbm(qkv: jax.Array) -> bool:
  """Whether the chunked path keeps its token arrays in HBM (`_HBM_TOKEN_BYTES`)."""
  return qkv.size * jnp.dtype(qkv.dtype).itemsize > _HBM_TOKEN_BYTES


def _requests_conv(qkv, conv_weight, conv_bias, taps, conv0, start, length, used, *,
                   at_least_window: bool):
  """SiLU(conv) [T, D] in qkv's dtype, right on the rows of the chunked
  requests (request n: tokens [start_n, start_n + length_n), its conv state
  `conv0` [N, W-1, D]); other rows are left for the caller to mask.

  No segment ids: the conv runs over all tokens with the SiLU in its kernel,
  so only each request's first W-1 rows are wrong (their windows reach into
  the tokens before it instead of its conv state). Those rows are recomputed
  here from the state and the request's first tokens and written in place:
  for one request every one of them at least W-1 tokens long
  (`at_least_window`), by a dynamic-update-slice of W-1 rows (at T - (W-1)
  when there is no request: rows nobody reads unmasked), else by a row
  scatter of each used request's first min(length, W-1) rows.
  """
  t_len, dim = qkv.shape
  n_max, kw1 = conv0.shape[0], taps.shape[0] - 1
  tiles = (dataclasses.replace(conv_pallas.heuristic_tiles(t_len, dim, block_t=_HBM_CONV_BLOCK_T),
                               in_hbm=True)
           if _in_hbm(qkv) else conv_pallas.heuristic_tiles(t_len, dim))
  act = conv_pallas.conv_tokens(qkv[None], conv_weight[:, 0, :], conv_bias, activation="silu",
                                config=tiles)[0]
  m = jnp.arange(kw1, dtype=jnp.int32)
  dus = n_max == 1 and at_least_window and t_len >= kw1
  if dus:
    at = jnp.minimum(start, t_len - kw1)
    head = jax.lax.dynamic_slice(qkv, (at[0], 0), (kw1, dim))[None]
  else:
    head = qkv[jnp.clip(start[:, None] + m[None, :], 0, t_len - 1)]               # [N, W-1, D]
  # xp = [conv state; the request's first W-1 tokens]; its row i reads xp[i : i + W].
  xp = jnp.concatenate([conv0, head.astype(_F32)], axis=1)
  bias = 0.0 if conv_bias is None else conv_bias.astype(_F32)
  rows = jax.nn.silu(bias + sum(taps[w] * xp[:, w:w + kw1] for w in range(kw1 + 1)))
  rows = rows.astype(act.dtype)
  if dus:
    return jax.lax.dynamic_update_slice(act, rows[0], (at[0], 0))
  dest = jnp.where(used[:, None] & (m[None, :] < length[:, None]), start[:, None] + m[None, :],
                   t_len)
  return act.at[dest.reshape(-1)].set(rows.reshape(-1, dim), mode="drop")


def _chunked_path(qkv, b, a, out, conv_pool, rec_pool, conv_weight, conv_bias, a_log, dt_bias,
                  reqs: base.Requests, chunked: jax.Array, n_max: int, min_chunked: int,
                  dims: base.Dims, cfg: Config, interpret: bool):
  """The chunked path over the (at most `n_max`) requests where `chunked`,
  each at least `min_chunked` tokens long; returns (`out` [T, Hv V] with
  their tokens' rows written (in place), pools)."""
  t_len, dim = qkv.shape
  n_req, kw1 = reqs.start.shape[0], dims.kernel_size - 1
  if n_max == 1:
    req = jnp.argmax(chunked)[None].astype(jnp.int32)     # 0 (unused) if none
  else:
    rank = jnp.cumsum(chunked.astype(jnp.int32)) - 1
    req = jnp.zeros((n_max,), jnp.int32).at[jnp.where(chunked, rank, n_max)].set(
        jnp.arange(n_req, dtype=jnp.int32), mode="drop")
  used = jnp.arange(n_max) < jnp.sum(chunked)
  start = jnp.where(used, reqs.start[req], t_len)
  length = jnp.where(used, reqs.length[req], 0)
  init = used & reqs.has_init[req]
  read = reqs.read_slot[req]
  conv0 = jnp.where(init[:, None, None], conv_pool[read].astype(_F32), 0.0)    # [N, W-1, D]
  taps = base.conv_weight_taps(conv_weight)                                   # [W, D]
  act = _requests_conv(qkv, conv_weight, conv_bias, taps, conv0, start, length, used,
                       at_least_window=min_chunked >= kw1)
  if n_max == 1 and min_chunked >= kw1:
    # Its new conv state: its own last W-1 tokens (it has at least W-1).
    conv_new = jax.lax.dynamic_slice(qkv, (jnp.maximum(start[0] + length[0] - kw1, 0), 0),
                                     (kw1, dim))[None]
  else:
    # New conv states: the last W-1 inputs of [conv state; tokens].
    m = jnp.arange(kw1)
    src = start[:, None] + length[:, None] - kw1 + m[None, :]                  # [N, W-1]
    from_state = src < start[:, None]
    state_rows = jnp.take_along_axis(
        conv0, jnp.clip(length[:, None] + m[None, :], 0, kw1 - 1)[..., None], axis=1)
    conv_new = jnp.where(from_state[..., None], state_rows,
                         qkv[jnp.clip(src, 0, t_len - 1)].astype(_F32))

  beta, g = base.gates(b, a, a_log, dt_bias)
  g = jnp.maximum(g, gdn_prologue.CHUNKED_LOG_DECAY_FLOOR)
  hv = dims.n_v
  interleave = gdn_common.normalize_interleave(16, hv, hv // dims.n_kq)
  # This kernel's own VMEM model (an upper bound of Mosaic's allocation),
  # with a quarter to spare up to what `check_vmem` accepts: a limit no
  # larger than needed leaves room for XLA's own VMEM (with the cycle dump
  # on, the full cap overflowed at T = 4096). The training forward's model
  # (`vmem_estimate(kernel="fwd")`), used here before, estimated 29.7 MiB for
  # 64 value heads where Mosaic allocates 41.1: its limit failed on the chip.
  need = _requests_vmem(dims, cfg.chunk_size, qkv.dtype, rec_pool.dtype)
  gdn_vmem.check_vmem(
      "causal_conv1d_gated_delta_rule", need, _vmem_cap(),
      f"the chunked path's GDN kernel at C = {cfg.chunk_size} ({hv} value heads,"
      f" {qkv.dtype} activations, {rec_pool.dtype} pool)")
  # Each request's blocks, from its read slot (straight from the pool), its
  # rows only (other tokens pass its state through, NaN or not); blocks that
  # hold no chunked request are skipped and move nothing.
  slot = jnp.where(used, reqs.write_slot[req], conv_pool.shape[0])
  out, rec_pool = gdn_requests.gdn_fwd_requests(
      act, g, beta, rec_pool,
      gdn_requests.PackedRequests(start=start, length=length, init=init, read=read, write=slot),
      out, hk=dims.n_kq, hv=hv, dim_k=dims.d_k, dim_v=dims.d_v, scale=dims.scale,
      chunk=cfg.chunk_size, interleave=interleave, all_run=bool(_chunk_cost),
      static_blocks=_chunk_cost is not None, in_hbm=_in_hbm(qkv), interpret=interpret,
      vmem_limit_bytes=min(gdn_vmem.accepted_need(_vmem_cap()), need * 5 // 4))
  if n_max == 1:
    # A dynamic-update-slice (row scatters, with their bounds checks, cost
    # more): without a chunked request, the
    # slot's own contents go back.
    conv_pool = _put_slot(conv_pool, reqs.write_slot[req[0]], conv_new[0], used[0])
  else:
    conv_pool = conv_pool.at[slot].set(conv_new.astype(conv_pool.dtype), mode="drop")
  return out, conv_pool, rec_pool


def _put_slot(pool, slot, value, write):
  """pool with pool[slot] = value (in the pool's dtype) where `write`, else
  unchanged (the slot read and written back)."""
  value = jnp.where(write, value.astype(pool.dtype), pool[slot])
  return jax.lax.dynamic_update_slice(pool, value[None], (slot,) + (0,) * value.ndim)


def _check_supported(qkv: jax.Array, dims: base.Dims) -> bool:
  """Returns interpret mode; raises NotImplementedError where the kernels can't run."""
  interpret = gdn_config.require_pallas_tpu("causal_conv1d_gated_delta_rule")
  if qkv.dtype not in (jnp.float32, jnp.bfloat16):
    raise NotImplementedError(f"pallas_mosaic_tpu supports float32/bfloat16 qkv; got {qkv.dtype}.")
  return interpret


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuCausalConv1dGatedDeltaRule(config_hooks.PallasTpuHooks,
                                                base.CausalConv1dGatedDeltaRule[Config, None]):
  """Decode kernel + chunked GDN kernel on state pools (see the module doc)."""

  op_name: ClassVar[str] = "causal_conv1d_gated_delta_rule"
  config_cls: ClassVar[type[Config]] = Config
  serve_zeroes_other_rows: ClassVar[bool] = True
  heuristics = _heuristics
  autotuning_configs = _autotuning_configs

  def _serve(self, qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
             dt_bias, reqs, *, dims, config: Config):
    interpret = _check_supported(qkv, dims)
    lanes = _lane_dims(dims)
    if lanes == dims:
      return self._serve_lanes(qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias,
                               a_log, dt_bias, reqs, dims=dims, config=config,
                               interpret=interpret)
    # Heads padded to whole lanes (module doc), and the results sliced back.
    pad = functools.partial(_pad_channels, dims=dims, lanes=lanes)
    rec = jnp.pad(recurrent_state,
                  ((0, 0), (0, 0), (0, lanes.d_k - dims.d_k), (0, lanes.d_v - dims.d_v)))
    (conv_pool, rec_pool), out = self._serve_lanes(
        pad(qkv), b, a, pad(conv_state), rec, pad(conv_weight, axis=0),
        None if conv_bias is None else pad(conv_bias), a_log, dt_bias, reqs, dims=lanes,
        config=config, interpret=interpret)
    t_len = out.shape[0]
    out = out.reshape(t_len, dims.n_v, lanes.d_v)[..., :dims.d_v].reshape(t_len, -1)
    return ((_unpad_channels(conv_pool, dims, lanes), rec_pool[..., :dims.d_k, :dims.d_v]),
            out)

  def _serve_lanes(self, qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
                   dt_bias, reqs, *, dims, config: Config, interpret: bool):
    """`_serve` at sizes the kernels take as they are (`_lane_dims`)."""
    t_len = qkv.shape[0]
    window = reqs.window
    min_chunked = max(config.min_chunked_tokens, window + 1)
    n_chunked = min(reqs.start.shape[0], t_len // min_chunked)     # static bound
    chunked = (reqs.valid & ~reqs.decode & (reqs.length >= min_chunked)
               if n_chunked else jnp.zeros_like(reqs.valid))
    runs = reqs.valid & ~chunked
    mid = min(min_chunked - 1, t_len) > window      # short prefills longer than a window
    out, conv_pool, rec_pool = _decode_path(
        qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias, reqs,
        runs, min_chunked if n_chunked else 0, dims, config, mid, interpret)
    if n_chunked:
      out, conv_pool, rec_pool = _chunked_path(
          qkv, b, a, out, conv_pool, rec_pool, conv_weight, conv_bias, a_log, dt_bias, reqs,
          chunked, n_chunked, min_chunked, dims, config, interpret)
    return (conv_pool, rec_pool), out


IMPLEMENTATION = PallasMosaicTpuCausalConv1dGatedDeltaRule()
