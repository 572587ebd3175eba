"""Compile-time description of the serving decode kernel, and its VMEM model.

`DecodeStatic` holds everything the kernel's trace depends on (sizes, the
tile, the window, which index arrays are given, its modes). The functions
here derive from it what the kernel body and the Op wrapper both need,
without tracing anything: the rows of the per-step request metadata, the
requests the grid covers, the scratch kept per request in flight
(`state_slots`, `bcast_slots`), the checkpoint buffer a window's token
writes, and the scoped VMEM of one grid step (`vmem_bytes`), which the
wrapper checks against the chip's cap before it compiles anything.
"""

import dataclasses

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class DecodeStatic:
  """Compile-time facts of the decode kernel."""

  n_kq: int
  n_v: int
  d_k: int
  d_v: int
  kernel_size: int
  window: int        # token positions per request held in the activation block
  tile: int          # requests per grid step
  mid_tokens: bool   # requests may hold more than `window` tokens (block DMAs)
  num_requests: int  # R (the index arrays' length)
  num_slots: int     # pool slots (read slots are clipped into them)
  # Requests that are not decodes and hold at least this many tokens do not
  # run here (the chunked path's); 0: every valid request runs here.
  min_chunked: int = 0
  has_bias: bool = True
  has_reads: bool = False     # read_state_indices given (else state_indices)
  has_offsets: bool = False   # read_offsets given
  # Window 1 with `mid_tokens`: the activation blocks are the token rows
  # themselves (request r's block row is token r), no gathered copy; a
  # request whose token is elsewhere (start != r) reads it and writes its
  # output row by the mid tokens' block DMAs (a decode batch, its requests
  # first, one token each, has none).
  direct: bool = False
  # Direct mode with the whole output as one block that stays in VMEM for
  # the grid (this many rows, 0: not resident): every row is written where
  # it is (a request's rows merged in by its own grid step, mid tokens'
  # rows by in-VMEM read-modify-writes), so the op needs no second output,
  # no zero fill in HBM and no add in XLA.
  resident_rows: int = 0
  num_tokens: int = 0   # T (direct mode's zero fill of `out_mid`)
  # Cost model only: compile as if every request ran its whole window (one
  # token, or `window` with every checkpoint written back) from an initial
  # state (no per-request branches). libtpu's static estimate skips
  # the bodies of data-dependent branches, so this is how the cost of a full
  # decode batch is measured (`all_run=False` in the op).
  all_run: bool = False
  # With `all_run`: whether those requests start from a read state (else
  # from zeros, with no read DMA), as the measured workload's do.
  all_init: bool = True
  # Traced for v5e: the bf16 pool's state and the hi / lo rows of q and k
  # take the forms libtpu's cycle estimator accepts there (see
  # `gated_delta_rule.pallas_mosaic_tpu_kernel`, "v5e forms").
  v5e_forms: bool = False
  # Pallas interpret mode (set by `decode`): the loops over a tile's requests
  # run as fori_loops, one traced copy of their bodies. Unrolled (as the TPU
  # kernel is with `rolled` 0, for its scheduler), interpret mode discharges
  # and XLA:CPU compiles every request's copy: the serving tests' kernel
  # compiles took most of their time.
  interpret: bool = False
  # Requests per iteration of a fori_loop over the tile's requests (their
  # GDN steps, a window's tokens), each read from f32 VMEM rows at a traced
  # index: the kernel's traced size, so its lower and compile time, stays
  # that of `rolled` requests whatever the tile. 0: every request of the
  # tile traced (Python-unrolled), which compiles in time linear in the tile.
  rolled: int = 0
  # The d_k of the query scale where the heads are padded (`base.Dims`).
  scale_d_k: int = 0
  # Tiles and groups of requests none of which runs here compute nothing
  # (their output rows zeros): a batch padded to its maximum size pays for
  # its running requests only. Off: they compute on whatever their buffers
  # hold and their rows are selected away (the tests' bit-for-bit check).
  skip_idle: bool = True

  @property
  def dim(self) -> int:
    return 2 * self.n_kq * self.d_k + self.n_v * self.d_v

  @property
  def group(self) -> int:
    return self.n_v // self.n_kq

  @property
  def scale(self) -> float:
    return (self.scale_d_k or self.d_k) ** -0.5

  @property
  def skips_idle(self) -> bool:
    """`skip_idle`, except in the cost model (`all_run`: nothing is idle)."""
    return self.skip_idle and not self.all_run



# Rows of the per-step int32 metadata (SMEM scratch [META_ROWS, tile]), derived
# in the kernel from the call's index arrays (`pallas_mosaic_tpu_decode_kernel._step_metadata`).
START, LENGTH, HAS_INIT, READ_SLOT, WRITE_SLOT, CHECKPOINTS = range(6)
META_ROWS = 6


GROUP = 8    # requests whose state DMAs one wait covers (n_w = 1)
BLOCK_ROWS = 16   # rows of the aligned blocks mid tokens move in (a bf16 tile)


def n_index(st: DecodeStatic) -> int:
  return 4 + st.has_reads + st.has_offsets


def padded_requests(st: DecodeStatic) -> int:
  """R_padded: the requests the grid covers (R rounded up to whole tiles)."""
  return -(-st.num_requests // st.tile) * st.tile


# Interleave windows (`state_slots`) only where a request's f32 state is at
# most this: at 64 value heads (4 MiB states) two interleaved requests took
# Mosaic 54.3 MiB of scoped VMEM for a tile of 2 on v6e (past its limit),
# and there the states' DMAs, not the steps' chains, are the cost.
_INTERLEAVE_STATE_BYTES = 1 << 20


def window_checkpoint(t, length, checkpoints, window: int):
  """The checkpoint buffer token t of a window writes (`window_group`): slot
  t - (length - checkpoints) where that is one, else a buffer in [0, window)
  that no DMA writes back or that a later token overwrites. Clamped at both
  ends: a chunked-path request has length 0 here and 1 checkpoint, and its
  last token's unclamped index (the window) would write past its buffers
  (into the next request's first; VMEM indices are not bounds-checked)."""
  return jnp.clip(t - (length - checkpoints), 0, window - 1)


def state_slots(st: DecodeStatic) -> int:
  """Requests whose windows run interleaved (`window_group`), each with its
  own f32 state, conv window and activation row in scratch: the rolled
  loop's requests per iteration; 1 unrolled, for states past
  _INTERLEAVE_STATE_BYTES, and for one-token decodes (whose steps keep
  their states in the checkpoint buffers)."""
  if st.window == 1 or 4 * st.n_v * st.d_k * st.d_v > _INTERLEAVE_STATE_BYTES:
    return 1
  return max(st.rolled, 1)


def bcast_slots(st: DecodeStatic) -> int:
  """Lane-broadcast buffers (`step_heads`): one per request whose steps are
  traced together."""
  return (st.rolled or st.tile) if st.window == 1 else state_slots(st)


def fill_rows(t_pad: int) -> int:
  """Rows of the zero block direct mode fills `out_mid` with (a divisor of
  t_pad, a multiple of BLOCK_ROWS, at most 256)."""
  n = min(t_pad, 256)
  while t_pad % n:
    n -= BLOCK_ROWS
  return n


def vmem_bytes(st: DecodeStatic, pool_itemsize: int, act_itemsize: int) -> int:
  """Scoped VMEM of one grid step: the state buffers (in + `window` out per
  request), the double-buffered activation blocks, f32 scratch; plus a
  margin for Mosaic's temporaries (one f32 state and the conv rows)."""
  state = st.n_v * st.d_k * st.d_v
  conv = (st.kernel_size - 1) * st.dim
  bufs = st.tile * (1 + st.window) * (state + conv) * pool_itemsize
  acts = 2 * 2 * st.tile * st.window * (st.dim + 2 * st.n_v + st.n_v * st.d_v) * act_itemsize
  bcast = bcast_slots(st) * 2 * st.d_k * st.d_v
  rows = st.tile * (st.dim + 2 * st.n_v) if st.direct else 0   # direct mode's f32 rows
  if st.rolled:   # the rolled loop's f32 rows (`decode`'s scratch)
    n = st.tile * st.window
    rows += n * ((2 if st.window == 1 else 1) * st.dim + 2 * st.n_v + st.n_v * st.d_v)
  if st.window > 1:   # `Window`'s key columns (laid out in whole 128 lanes)
    bcast += state_slots(st) * st.n_kq * st.d_k * 128 * -(-st.window // 128)
  scratch = 4 * (state_slots(st) * (state + conv + st.window * st.dim) + bcast + rows)
  out_row = st.n_v * st.d_v * act_itemsize
  if st.resident_rows:
    outs = (2 * st.resident_rows + st.tile) * out_row
  elif st.direct:
    outs = fill_rows(-(-st.num_tokens // BLOCK_ROWS) * BLOCK_ROWS) * out_row
  else:
    outs = 0
  # Mosaic's temporaries, two f32 states: a margin that held on the chip
  # (dp8_ep8_prefill_512, 64 heads: Mosaic allocated 55.1 MiB where this
  # estimates 55.9; with two heads instead of two states, 48.1); as much
  # again for each further request whose window runs interleaved.
  return bufs + acts + scratch + outs + 2 * 4 * state * state_slots(st) + (4 << 20)
