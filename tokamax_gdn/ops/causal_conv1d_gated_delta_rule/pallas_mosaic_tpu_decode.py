"""Pallas Mosaic TPU decode kernel of the serving GDN: conv window + GDN step, fused.

One grid step takes a tile of `tile` requests; it derives their metadata
(token range, read and write slots, whether each runs here) from the call's
index arrays in SMEM, and reads the layer's weights in their own dtypes, so
that no XLA op prepares either (each such op cost more than its work).
Each request's states live in
the pools (HBM, `memory_space=ANY`, aliased in place): the step starts one DMA
per request and state (recurrent [Hv, K, V], conv [W-1, D]) from the read slot
(scalar-prefetched) and waits for the write-backs at its end. Requests that
do not run here (invalid, padding, or chunked-path requests) start no DMA at
all, which keeps every slot they name bit-identical. A tile, or a group of
requests within one, none of which runs here computes nothing either
(`DecodeStatic.skip_idle`): a batch padded to a bucket of requests pays for
the requests that run, not for the bucket.

One-token decodes (window 1): the tile's conv, gates and q/k run vectorised
over its requests; then the GDN steps run in groups of `_GROUP` requests: one
wait for the group's state reads, the group's heads with no wait or branch
between them (so the scheduler interleaves the requests' MXU and update
chains), then the group's write-backs start. Later groups' reads and earlier
groups' writes overlap the compute. Requests that do not run compute on
whatever their buffers hold; their output rows are selected away and none
of their states is written back. A group none of whose requests reads a
state (all start from zeros) takes state-free steps: S' = k v_new^T, no
product with S and no decay of it. A wait (and a `pl.when`) per request had
left each request's chain exposed (on the v6e estimate, groups of 8 cut a
quarter of a cached decode's cost).

Rolled (`DecodeStatic.rolled` = n > 0, the default): the groups are n
requests, the iterations of a `lax.fori_loop` over the tile, so the traced
kernel holds n requests' steps (and their short-prefill and elsewhere
tails) whatever the tile: lower and compile time no longer grow with it.
The loop reads each request's rows at a traced index from f32 VMEM that
the vectorised prologue fills ([x; q | k | v], [beta; decay]; one row at
a dynamic sublane offset is a load Mosaic has in f32, not in bf16), takes
its q / k columns by one (8, K) transpose, and writes its output row to
f32 VMEM, copied to the output block after the loop. Unrolled (n = 0) every
request of the tile is traced, in groups of `_GROUP`.

Windows of several tokens (`window_group`) loop over the tile's requests the
same way, n per iteration, each window's tokens at once (`_Window`: the
in-window products as small matrices, then each checkpoint a rank-one
update of the previous one), phase by phase over the n requests and their
heads, with no branch or wait between them; every token of the window
computes (those past a request's length are selected away, and none reaches
an earlier one). A short prefill longer than the window then runs token by
token from its first token again, its state in f32 scratch (`state_slots`).
The token-by-token scan that windows ran before (a branch per request and
token at first, then two requests interleaved) spent most of its bundles on
products of q and k with the f32 state and on spilling (v5e estimate of
tp8_spec3_decode_64_ctx1024's kernel: 227 k cycles then, 121 k now).

Why every DMA is started and waited in the same grid step: libtpu's static
cycle estimator aborts ("No DMA issue node found for sync flag") on a wait
whose DMA was issued in an earlier grid step or loop iteration, and each
kernel must stay estimable. One semaphore per DMA (a shared one measured 2x
slower on the estimate: the waits serialise).

Activations: for one-token decodes (`direct`) the kernel's blocks are the
token arrays themselves, request r's row being token r (a decode batch:
decode requests first, one token each); a request whose token is elsewhere
(a short prefill after the decodes) reads its row and writes its output row
by the aligned block DMAs of `mid_tokens`. The output stays in VMEM for the
whole grid where it is small (`resident_rows`: every row written where it
is, no XLA op after the kernel); else those rows go to a second output,
zeroed by the first grid step, and the op's output is the sum of the two.
This drops the XLA row gathers
of qkv / b / a and of the output. Verify windows take gathered blocks (row
r * window + t).

Per token (positions t < `window` from the activation block; longer short
requests continue token by token from aligned row blocks, `mid_tokens`):

  pre = bias + sum_w taps[w] * [conv window; x_t][w];  x = silu(pre)
  q, k L2-normalised (q also scaled by d_k^-1/2), beta = sigmoid(b),
  g = -exp(a_log) softplus(a + dt_bias)
  qS, kS: for a state read from a bf16 pool, [q; k] S on the MXU (one
  (8, K) x (K, V) product per value head, S an exact bf16 operand, q and k
  as bf16 hi + lo rows, so the products keep ~2^-16); for a float32 state,
  VPU products with q and k broadcast along lanes and sublane sums,
  v_new = beta (v - e^g kS),  o = e^g qS + (q.k) v_new,
  S' = e^g S + k v_new^T on the VPU, stored in the pool's dtype.

Heads of one GVA group share their q/k rows and lane broadcasts. Everything
is float32 between products; the state is read in the pool's dtype and
converted once.
"""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops import numerics

F32, BF16 = jnp.float32, jnp.bfloat16
_L2_EPS = 1e-6
_ROWS = 8   # MXU row operand height (one f32 sublane tile)


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


# Rows of the per-step int32 metadata (SMEM scratch [_META, tile]), derived
# in the kernel from the call's index arrays (`_step_metadata`).
START, LENGTH, HAS_INIT, READ_SLOT, WRITE_SLOT, CHECKPOINTS = range(6)
_META = 6


def _each(st: DecodeStatic, lo: int, hi: int, body, roll: bool = False):
  """body(j) for j in range(lo, hi): unrolled, j a Python int (the TPU
  kernel), or in interpret mode (`st.interpret`), or where `roll` and
  `st.rolled`, a fori_loop, j traced."""
  if (st.interpret or (roll and st.rolled)) and hi - lo > 1:
    def step(j, carry):
      body(j)
      return carry

    lax.fori_loop(lo, hi, step, 0)
  else:
    for j in range(lo, hi):
      body(j)


def _at(j, n: int = 1):
  """Index of rows j..j+n of a ref: a static slice, or pl.ds for a traced j."""
  return slice(j, j + n) if isinstance(j, int) else pl.ds(j, n)


def _take(x, j, axis: int = 0):
  """Row (axis 0) or column (axis 1) j of a value, kept as a size-1 axis."""
  if isinstance(j, int):
    return x[j:j + 1] if axis == 0 else x[:, j:j + 1]
  return lax.dynamic_slice_in_dim(x, j, 1, axis)


def _step_metadata(st: DecodeStatic, base, idx, meta_scr):
  """Fills meta_scr[:, j] for requests base + j of this grid step from the
  index arrays in SMEM (`idx`: qsl, state_indices, distribution, seq_lens
  and, when given, read_state_indices, read_offsets), as
  `base.Requests.build` does in XLA; LENGTH is 0 for requests that do not
  run here (invalid, padding, past R, or the chunked path's). Scalar work,
  where the same values built in XLA cost several small ops."""
  idx = list(idx)
  qsl, slots, dist, seq_lens = idx[:4]
  reads = idx[4] if st.has_reads else slots
  offsets = idx[-1] if st.has_offsets else None
  r_max = st.num_requests
  num_valid = jnp.clip(dist[2], 0, r_max)
  num_decode = jnp.clip(dist[0], 0, num_valid)
  exact = r_max % st.tile == 0

  def request(j):
    r = base + j
    rc = r if exact else jnp.minimum(r, r_max - 1)
    start = qsl[rc]
    length = qsl[rc + 1] - start
    read = reads[rc] if offsets is None else reads[rc] + offsets[rc]
    # A request whose slots lie outside the pool runs nowhere (`base.Requests.bad`).
    asked = jnp.logical_and(r < num_valid, length > 0)
    writes = jnp.where(jnp.logical_and(asked, r < num_decode), jnp.minimum(length, st.window), 1)
    outside = jnp.logical_or(
        jnp.logical_or(slots[rc] < 0, slots[rc] + writes > st.num_slots),
        jnp.logical_and(seq_lens[rc] > length,
                        jnp.logical_or(read < 0, read >= st.num_slots)))
    valid = jnp.logical_and(asked, jnp.logical_not(outside))
    decode = jnp.logical_and(valid, r < num_decode)
    length = jnp.where(valid, length, 0)
    runs = valid
    if st.min_chunked:
      runs = jnp.logical_and(valid, jnp.logical_or(decode, length < st.min_chunked))
    meta_scr[START, j] = jnp.where(valid, start, 0)
    meta_scr[LENGTH, j] = jnp.where(runs, length, 0)
    meta_scr[HAS_INIT, j] = jnp.logical_and(valid, seq_lens[rc] > length).astype(jnp.int32)
    meta_scr[READ_SLOT, j] = jnp.clip(read, 0, st.num_slots - 1)
    meta_scr[WRITE_SLOT, j] = slots[rc]
    meta_scr[CHECKPOINTS, j] = jnp.where(decode, jnp.minimum(length, st.window),
                                         valid.astype(jnp.int32))

  _each(st, 0, st.tile, request, roll=True)


def _split(x):
  """float32 -> (hi, lo) bfloat16 with hi + lo = x to ~2^-16 relative."""
  hi = x.astype(BF16)
  return hi, (x - hi.astype(F32)).astype(BF16)


def _qk_pieces(q, k, v5e_forms: bool):
  """[q_hi, q_lo, k_hi, k_lo], the left operand's pieces of [q; k] S against
  a bf16 state; with the v5e forms (`numerics.split`) float32, to be stacked
  then cast to bf16 once."""
  if v5e_forms:
    return [w for x in (q, k) for _, w in numerics.split(x, 2, True)]
  return [*_split(q), *_split(k)]


def _rows(parts, width, zero=0.0):
  """(k, width) pieces stacked and padded with `zero` to (_ROWS, width)."""
  x = jnp.concatenate(parts, axis=0)
  pad = _ROWS - x.shape[0]
  return jnp.concatenate([x, jnp.full((pad, width), zero, x.dtype)], axis=0) if pad else x


def _dot(a, b):
  return lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=F32)


def _dot_ta(a, b):
  """aᵀ b contracting the (padded) row axis: a sum of outer products."""
  return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=F32)


def _l2norm(x):
  return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2_EPS)


class _Params(NamedTuple):
  """The layer's weights, in their dtypes as passed: conv taps (W, D) (tap w
  multiplies the input W-1-w back), conv bias (1, D) or None, a_log and
  dt_bias (1, Hv)."""

  taps: Any
  bias: Any
  a_log: Any
  dt_bias: Any


class _Prepared:
  """The per-token values every head needs, for n tokens at once (rows)."""

  def __init__(self, st: DecodeStatic, x, windows, b, a, prm: _Params, act_scr):
    """x (n, D), b / a (n, Hv) float32; windows: W-1 arrays (n, D), the conv
    window's rows oldest first."""
    kw = st.kernel_size
    taps = prm.taps[...].astype(F32)
    pre = taps[kw - 1:kw, :] * x
    if prm.bias is not None:
      pre = pre + prm.bias[...].astype(F32)
    for w in range(kw - 1):
      pre = pre + taps[w:w + 1, :] * windows[w]
    # Through VMEM: libtpu's estimator rejects a loaded value that reaches an
    # MXU operand through elementwise float32 math without a store between.
    act_scr[...] = pre * jax.nn.sigmoid(pre)
    self.act = act_scr[...]
    self.beta = jax.nn.sigmoid(b)
    g = (-jnp.exp(prm.a_log[...].astype(F32))
         * jax.nn.softplus(a + prm.dt_bias[...].astype(F32)))
    self.decay = jnp.exp(g)                                              # (n, Hv)
    dk, kd = st.d_k, st.n_kq * st.d_k
    self.q, self.k, self.qk, self.q_cols, self.k_cols = [], [], [], [], []
    for i in range(st.n_kq):
      q = _l2norm(self.act[:, i * dk:(i + 1) * dk]) * st.scale
      k = _l2norm(self.act[:, kd + i * dk:kd + (i + 1) * dk])
      self.q.append(q)
      self.k.append(k)
      self.qk.append(jnp.sum(q * k, axis=-1, keepdims=True))            # (n, 1)
      self.q_cols.append(_pad_rows(q).T)                                 # (K, >= n)
      self.k_cols.append(_pad_rows(k).T)


def _pad_rows(x):
  """(n, L) -> (round_up(n, 8), L), zero rows below."""
  pad = -x.shape[0] % _ROWS
  return jnp.concatenate([x, jnp.zeros((pad, x.shape[1]), x.dtype)], axis=0) if pad else x


class _Row:
  """`_Prepared`'s values for one token (row 0), from the rows the rolled
  loop reads at a traced index: `qkv` (1, D) [q (scaled) | k, each
  L2-normalised per key head | v], beta and decay (1, Hv)."""

  def __init__(self, st: DecodeStatic, qkv, beta, decay):
    dk, kd = st.d_k, st.n_kq * st.d_k
    self.act, self.beta, self.decay = qkv, beta, decay
    self.q, self.k, self.qk, self.q_cols, self.k_cols = [], [], [], [], []
    for i in range(st.n_kq):
      q = qkv[:, i * dk:(i + 1) * dk]
      k = qkv[:, kd + i * dk:kd + (i + 1) * dk]
      self.q.append(q)
      self.k.append(k)
      self.qk.append(jnp.sum(q * k, axis=-1, keepdims=True))
      # One (8, K) transpose gives both columns (a traced row has no
      # vectorised transpose to share).
      cols = _rows([q, k], dk).T                                         # (K, 8)
      self.q_cols.append(cols[:, 0:1])
      self.k_cols.append(cols[:, 1:2])


def _heads(st: DecodeStatic, p: _Prepared, row: int, bcast_scr, s_read, s_write):
  """The GDN step of every value head for token `row` of `p`: returns its
  output row (1, Hv V) float32. `s_read(h)` gives head h's state (K, V)
  (float32, or the bf16 pool's values as read), or is None for a request
  that starts from zeros; `s_write(h, s)` stores the new one (float32).
  `bcast_scr` (2, K, V) f32 is this token's own: the tokens of a group of
  requests run interleaved, so they must not share it."""
  dk, dv, kd = st.d_k, st.d_v, st.n_kq * st.d_k
  one = lambda x: _take(x, row)
  beta, decay = one(p.beta), one(p.decay)
  outs = []
  for i in range(st.n_kq):
    q, k, qk = one(p.q[i]), one(p.k[i]), one(p.qk[i])
    heads = range(i * st.group, (i + 1) * st.group)
    states = [None if s_read is None else s_read(h) for h in heads]
    # Lane broadcasts run on the XLU, the scarce unit here: once per key
    # head into VMEM, then every head of the GVA group loads them. q's only
    # for float32 states (bf16 ones take q S on the MXU).
    if any(x is not None and x.dtype != BF16 for x in states):
      bcast_scr[0] = jnp.broadcast_to(_take(p.q_cols[i], row, 1), (dk, dv))
    bcast_scr[1] = jnp.broadcast_to(_take(p.k_cols[i], row, 1), (dk, dv))
    if s_read is not None and st.v5e_forms:
      # Stacked in f32 and cast once, padded with -0.0 (`numerics.lhs_masked`).
      lhs = _rows(_qk_pieces(q, k, True), dk, -0.0).astype(BF16)
    elif s_read is not None:
      lhs = _rows(_qk_pieces(q, k, False), dk)
    for h, s in zip(heads, states):
      e = decay[:, h:h + 1]
      k_col = bcast_scr[1]
      v_cols = slice(2 * kd + h * dv, 2 * kd + (h + 1) * dv)
      v = p.act[row:row + 1, v_cols] if isinstance(row, int) else _take(p.act, row)[:, v_cols]
      if s is None:
        # S = 0: qS = kS = 0 and S' = k v_new^T, no product and no decay of
        # S (e * 0 keeps a NaN or inf decay in, as e * S would).
        v_new = beta[:, h:h + 1] * (v + e * 0.0)
        outs.append(qk * v_new)
        s_write(h, k_col * v_new)
        continue
      if s.dtype == BF16:
        # A bf16 pool's state is an exact MXU operand: [q; k] S in one
        # product (q, k as bf16 hi + lo rows), beside the VPU's update.
        # v5e forms: the operand is cast from the widened state (exact), not
        # the value that is widened.
        if st.v5e_forms:
          s = s.astype(F32)
          r = _dot(lhs, numerics.round_bf16(s)[0])
        else:
          r = _dot(lhs, s)
          s = s.astype(F32)
        q_s, k_s = r[0:1] + r[1:2], r[2:3] + r[3:4]
      else:
        s = s.astype(F32)
        q_s = jnp.sum(bcast_scr[0] * s, axis=0, keepdims=True)         # (1, V)
        k_s = jnp.sum(k_col * s, axis=0, keepdims=True)
      v_new = beta[:, h:h + 1] * (v - e * k_s)                          # (1, V)
      outs.append(e * q_s + qk * v_new)
      s_write(h, e * s + k_col * v_new)
  return jnp.concatenate(outs, axis=1)


def _token(st: DecodeStatic, x_row, b_row, a_row, prm: _Params, win_scr, act_scr, bcast_scr,
           s_read, s_write):
  """One token of one request (rows (1, ...) float32); advances the conv
  window in `win_scr` (W-1, D) f32; returns the output row (1, Hv V)."""
  kw = st.kernel_size
  win = win_scr[...]
  p = _Prepared(st, x_row, [win[w:w + 1] for w in range(kw - 1)], b_row, a_row, prm, act_scr)
  win_scr[...] = jnp.concatenate([win[1:], x_row], axis=0) if kw > 2 else x_row
  return _heads(st, p, 0, bcast_scr, s_read, s_write)


class _Window:
  """The n tokens of one request's verify window at once, in three phases
  (`products`, `solve`, `checkpoints`) that `window_group` runs phase by
  phase over its requests, so that the MXU products of every head are
  issued together (the MXUs take products in program order: a head's
  products behind the previous head's chain of VPU steps serialised them).

  Per value head, with G the in-window cumsum of the log-decays g (G_t =
  g_0 + ... + g_t), Gamma_ts = exp(G_t - G_s) for s <= t, S0 the read state:
    [Q; K] S0 in one MXU product (as a one-token step's [q; k] S),
    A_ts = beta_t Gamma_ts (k_t . k_s) for s < t,  M_ts = Gamma_ts (q_t . k_s)
    for s <= t (the Grams in three bf16 passes, ~f32),
    (I + A) V' = beta (V - exp(G) K S0)  by forward substitution,
    O = exp(G) Q S0 + M V',
  the rows a token-by-token scan computes (v_new_t = V'_t); then the
  checkpoints S_t = exp(g_t) S_{t-1} + k_t V'_t^T, a rank-one update each.
  So a token costs that update of each head's state and no product of q
  or k with a state: the per-token scan spent ~4/5 of its bundles on those
  products (VPU reductions against the f32 state held in VMEM) and on
  spilling the interleaved heads' states (v5e LLO of
  tp8_spec3_decode_64_ctx1024).

  Causal as the scan: every mask is a select, never a product with zero
  (a NaN or inf in token s, or in tokens past the request's length,
  gathered from other requests, reaches no row or state before it).
  """

  def __init__(self, st: DecodeStatic, x, b, a, win, prm: _Params, act_scr, k_scr, conv_write):
    """x, b, a: rows (n, ...) float32; `win` the conv window (W-1, D) as the
    window starts; `act_scr` (n, D) and `k_scr` (Hk, K, >= n) float32 this
    request's own; `conv_write(t, w)` stores the conv window after token t
    (W-1, D)."""
    self.st = st
    n, kw1 = x.shape[0], st.kernel_size - 1
    dk, kd = st.d_k, st.n_kq * st.d_k
    self.n = n
    pad = -0.0 if st.v5e_forms else 0.0
    taps = prm.taps[...].astype(F32)
    xp = jnp.concatenate([win, x], axis=0)                  # (W-1 + n, D), oldest first
    pre = taps[0:1, :] * xp[0:n]
    if prm.bias is not None:
      pre = pre + prm.bias[...].astype(F32)
    for w in range(1, kw1 + 1):
      pre = pre + taps[w:w + 1, :] * xp[w:w + n]
    for t in range(n):
      conv_write(t, xp[t + 1:t + 1 + kw1])
    # Through VMEM, as `_Prepared` (libtpu's estimator, MXU operands).
    act_scr[...] = pre * jax.nn.sigmoid(pre)
    self.act = act = act_scr[...]
    self.beta = jax.nn.sigmoid(b)
    self.g = -jnp.exp(prm.a_log[...].astype(F32)) * jax.nn.softplus(
        a + prm.dt_bias[...].astype(F32))
    self.big_g = self._cumsum(self.g)                       # (n, Hv)
    # Per key head (lists over i): MXU operands, and (n, V) rows broadcast
    # along a head's lanes once for the heads of its GVA group (lane
    # broadcasts are XLU permutes, ~9 cycles each: the scarce unit here).
    self.qk_rows, self.lhs, self.qk_cols, self.kk_cols = [], [], [], []
    self.k_cols = k_scr
    lanes = lambda col: jnp.broadcast_to(col, (n, st.d_v))
    for i in range(st.n_kq):
      q = _l2norm(act[:, i * dk:(i + 1) * dk]) * st.scale
      k = _l2norm(act[:, kd + i * dk:kd + (i + 1) * dk])
      k_scr[i] = _pad_rows(k).T                             # k_t in column t
      qk_rows = _rows([q, k], dk, pad) if 2 * n < _ROWS else jnp.concatenate([q, k], axis=0)
      gram = numerics.mxu(qk_rows, _rows([k], dk, pad) if n < _ROWS else k, tb=True,
                          passes=3, v5e_forms=st.v5e_forms)
      self.qk_cols.append([lanes(gram[0:n, c:c + 1]) for c in range(n)])      # q_t . k_c
      self.kk_cols.append([lanes(gram[n:2 * n, c:c + 1]) for c in range(n - 1)])  # k_t . k_c
      # [q_hi; q_lo; k_hi; k_lo] for bf16 states (as `_heads`, v5e forms
      # included); [q; k] for float32 ones.
      self.lhs.append(jnp.concatenate(_qk_pieces(q, k, st.v5e_forms), axis=0).astype(BF16))
      self.qk_rows.append(qk_rows)
    self.q_s, self.k_s, self.v_new = {}, {}, {}

  def _cumsum(self, y):
    """Over rows, row by row (a matmul by a triangle of ones would take a
    NaN of a later row into the earlier ones)."""
    rows = [y[0:1]]
    for t in range(1, self.n):
      rows.append(rows[-1] + y[t:t + 1])
    return jnp.concatenate(rows, axis=0) if self.n > 1 else y

  def heads(self):
    return range(self.st.n_v)

  def products(self, h, s):
    """[Q; K] S0 of head h, `s` its state as read (the pool's dtype)."""
    n, st, i = self.n, self.st, h // self.st.group
    if s.dtype == BF16:
      # The bf16 pool's state is an exact MXU operand, as loaded: widened,
      # it is a load of its own (`checkpoints`), so that the v5e forms'
      # rounding of the widened state (`_heads`) is not needed here.
      r = _dot(self.lhs[i], s)
      self.q_s[h], self.k_s[h] = r[0:n] + r[n:2 * n], r[2 * n:3 * n] + r[3 * n:4 * n]
    else:
      r = numerics.mxu(self.qk_rows[i], s.astype(F32), passes=3, v5e_forms=st.v5e_forms)
      self.q_s[h], self.k_s[h] = r[0:n], r[n:2 * n]

  def solve(self, h):
    """The output rows (n, V) of head h; keeps its V' for `checkpoints`.

    Rows are tokens t, lanes the head's V: a head's G_t and beta_t are
    broadcast along its lanes once, and every Gamma_ts is exp(G_t - G_s)
    from those rows (the EUP; sublane broadcasts of row s), not a column of
    an (n, n) matrix broadcast along lanes."""
    n, st, i = self.n, self.st, h // self.st.group
    dv, kd = st.d_v, st.n_kq * st.d_k
    rows = lax.broadcasted_iota(jnp.int32, (n, dv), 0)
    g_b = jnp.broadcast_to(self.big_g[:, h:h + 1], (n, dv))      # G_t
    b_b = jnp.broadcast_to(self.beta[:, h:h + 1], (n, dv))       # beta_t
    gam = jnp.exp(g_b)
    v = self.act[:, 2 * kd + h * dv:2 * kd + (h + 1) * dv]
    v_new = b_b * (v - gam * self.k_s.pop(h))                    # right-hand side
    # Gamma_tc (rows t >= c; 1 above them, where nothing reads it).
    gam_c = [jnp.exp(jnp.where(rows >= c, g_b - g_b[c:c + 1, :], 0.0)) for c in range(n)]
    for c in range(n - 1):
      a_c = b_b * gam_c[c] * self.kk_cols[i][c]
      v_new = jnp.where(rows > c, v_new - a_c * v_new[c:c + 1, :], v_new)
    out = gam * self.q_s.pop(h)
    for c in range(n):
      out = out + jnp.where(rows >= c, gam_c[c] * self.qk_cols[i][c] * v_new[c:c + 1, :], 0.0)
    self.v_new[h] = v_new
    return out

  def checkpoints(self, i, s_read, s_write):
    """S_t of the heads of key head i for every token t, from their states
    as read: S_t = exp(g_t) S_{t-1} + k_t V'_t^T on the VPU (an MXU product
    of K^T and a W_t costs its 128 rows per 128 lanes whatever the
    contraction: 4x the VPU's rank-one update; v5e estimate of
    tp8_spec3_decode_64_ctx1024's kernel 133 k cycles that way, 121 k this
    way). In slabs of `_SLAB` state rows with the GVA group's heads
    together, a slab's broadcast k columns serving every head (3 % fewer
    cycles than whole states head by head; a fori_loop over the slabs, to
    hold less in registers, took twice as many). `s_read(h, rows)` gives
    rows of head h's state as read, `s_write(h, t, rows, s)` stores them
    after token t (float32)."""
    n, st = self.n, self.st
    dk, dv = st.d_k, st.d_v
    heads = range(i * st.group, (i + 1) * st.group)
    decay = {h: jnp.exp(jnp.broadcast_to(self.g[:, h:h + 1], (n, dv))) for h in heads}
    v_new = {h: self.v_new.pop(h) for h in heads}
    k_cols = self.k_cols.at[i]

    for r0 in range(0, dk, _SLAB):
      rows = slice(r0, min(r0 + _SLAB, dk))      # (d_k under 16 rows: interpret mode)
      cols = k_cols[rows, :]
      k_t = [jnp.broadcast_to(cols[:, t:t + 1], (cols.shape[0], dv)) for t in range(n)]
      for h in heads:
        s = s_read(h, rows).astype(F32)
        for t in range(n):
          s = decay[h][t:t + 1, :] * s + k_t[t] * v_new[h][t:t + 1, :]
          s_write(h, t, rows, s)


_SLAB = 16   # state rows a window's checkpoints are built in (a bf16 tile)


_GROUP = 8    # requests whose state DMAs one wait covers (n_w = 1)
_BLOCK = 16   # rows of the aligned blocks mid tokens move in (a bf16 tile)
BLOCK_ROWS = _BLOCK


def _pick_row(block, r):
  """Row r (traced) of a (_BLOCK, L) float32 block, as (1, L), by a masked sum
  (a dynamic sublane offset is not a vector load Mosaic has for every dtype)."""
  rows = lax.broadcasted_iota(jnp.int32, block.shape, 0)
  return jnp.sum(jnp.where(rows == r, block, 0.0), axis=0, keepdims=True)


def _n_index(st: DecodeStatic) -> int:
  return 4 + st.has_reads + st.has_offsets


def _kernel(*refs, st: DecodeStatic):
  refs = list(refs)
  idx = refs[:_n_index(st)]
  refs = refs[_n_index(st):]
  x_ref, b_ref, a_ref, taps_ref = refs[:4]
  refs = refs[4:]
  bias_ref = refs.pop(0) if st.has_bias else None
  prm = _Params(taps_ref, bias_ref, refs.pop(0), refs.pop(0))
  if st.mid_tokens:
    qkv_any, b_any, a_any = refs.pop(0), refs.pop(0), refs.pop(0)
  conv_in, rec_in = refs.pop(0), refs.pop(0)
  o_ref = refs.pop(0)
  resident = st.resident_rows > 0
  o_mid = refs.pop(0) if st.mid_tokens and not resident else None
  conv_out, rec_out = refs.pop(0), refs.pop(0)
  (conv_ibuf, rec_ibuf, conv_obuf, rec_obuf, win_scr, act_scr, bcast_scr, s_scr, sem_in,
   sem_out, meta_scr) = refs[:11]
  refs = refs[11:]
  k_scr = refs.pop(0) if st.window > 1 else None
  roll = st.rolled > 0
  roll_bufs = refs[:3] if roll else ()
  blk_bufs = refs[len(roll_bufs):]
  base = pl.program_id(0) * st.tile
  del conv_out, rec_out     # aliased with conv_in / rec_in: the DMAs write those
  n_w = st.window
  kw1 = st.kernel_size - 1
  _step_metadata(st, base, idx, meta_scr)

  def meta(field, j):
    return meta_scr[field, j]

  def read_conv(j):
    return pltpu.make_async_copy(conv_in.at[meta(READ_SLOT, j)], conv_ibuf.at[j], sem_in.at[0, j])

  def read_rec(j):
    return pltpu.make_async_copy(rec_in.at[meta(READ_SLOT, j)], rec_ibuf.at[j], sem_in.at[1, j])

  def writes(j, c):
    slot = meta(WRITE_SLOT, j) + c
    return (pltpu.make_async_copy(conv_obuf.at[j, c], conv_in.at[slot], sem_out.at[0, j, c]),
            pltpu.make_async_copy(rec_obuf.at[j, c], rec_in.at[slot], sem_out.at[1, j, c]))

  def when(cond):
    """pl.when, or static: unconditional / nothing (`all_run`'s conditions)."""
    if isinstance(cond, bool):
      return (lambda f: f()) if cond else (lambda f: None)
    return pl.when(cond)

  def runs(j):
    return True if st.all_run else meta(LENGTH, j) > 0

  def any_runs(js):
    """Whether any of requests `js` runs here (traced; `skips_idle` only)."""
    return functools.reduce(jnp.logical_or, [runs(j) for j in js])

  def init_of(j):
    return st.all_init if st.all_run else meta(HAS_INIT, j) > 0

  def loads(j):
    return st.all_init if st.all_run else jnp.logical_and(runs(j), init_of(j))

  def writes_ckpt(j, c):
    if st.all_run:
      # The cost model's requests run whole windows (as a spec batch's), so
      # each writes back every checkpoint.
      return True
    return jnp.logical_and(runs(j), c < meta(CHECKPOINTS, j))

  def conv_window(j):
    """Request j's conv window (W-1, D) f32 as it starts: its read slot's
    (loaded into conv_ibuf) where it reads one, else zeros."""
    init = init_of(j)
    conv = conv_ibuf[j].astype(F32)
    return conv if init is True else jnp.where(init, conv, 0.0)

  def zero_unread(j):
    @when(jnp.logical_not(init_of(j)) if not st.all_run else not st.all_init)
    def _():
      rec_ibuf[j] = jnp.zeros(rec_ibuf.shape[1:], rec_ibuf.dtype)

  def first_read(j):
    # The first token reads the state as loaded (a bf16 pool's values are
    # exact bf16 MXU operands).
    return lambda h: rec_ibuf[j, h].astype(F32) if pool_f32 else rec_ibuf[j, h]

  def slot_read(o):
    return lambda h: s_scr[o, h]

  def slot_write(o):
    def write(h, s):
      s_scr[o, h] = s
    return write

  def fetch_row(pos):
    """Token `pos`'s (x, b, a) rows (1, ...) float32, from aligned _BLOCK-row
    blocks of the padded [T, ...] arrays; also loads `o_mid`'s block of it
    for `put_row`. Returns (x, b, a, r): r is pos's row in its block."""
    x_blk, b_blk, a_blk, o_blk, sem_blk = blk_bufs[:5]
    blk = pl.multiple_of((pos // _BLOCK) * _BLOCK, _BLOCK)
    rows = pl.ds(blk, _BLOCK)
    pairs = [(qkv_any, x_blk), (b_any, b_blk), (a_any, a_blk)]
    if not resident:
      pairs.append((o_mid, o_blk))
    cps = [pltpu.make_async_copy(src.at[rows], dst, sem_blk.at[i])
           for i, (src, dst) in enumerate(pairs)]
    for cp in cps:
      cp.start()
    for cp in cps:
      cp.wait()
    r = pos - blk
    return (_pick_row(x_blk[...].astype(F32), r), _pick_row(b_blk[...].astype(F32), r),
            _pick_row(a_blk[...].astype(F32), r), r)

  def put_row(pos, r, out):
    """Merges the output row of token `pos` into its block of `o_mid` (read by
    the `fetch_row(pos)` just before; read, modify, write: tokens run in
    order, so no two writes of a block overlap)."""
    o_blk, sem_blk = blk_bufs[3], blk_bufs[4]
    blk = pl.multiple_of((pos // _BLOCK) * _BLOCK, _BLOCK)
    sel = lax.broadcasted_iota(jnp.int32, o_blk.shape, 0) == r
    if resident:
      rows = pl.ds(blk, _BLOCK)
      o_ref[rows, :] = jnp.where(sel, out, o_ref[rows, :].astype(F32)).astype(o_ref.dtype)
      return
    o_blk[...] = jnp.where(sel, out, o_blk[...].astype(F32)).astype(o_blk.dtype)
    cp = pltpu.make_async_copy(o_blk, o_mid.at[pl.ds(blk, _BLOCK)], sem_blk.at[4])
    cp.start()
    cp.wait()

  def elsewhere(j):
    """Direct mode: request j runs, but its token is not block row j."""
    return jnp.logical_and(runs(j), meta(START, j) != base + j)

  def mid_tokens(j, store, o=0, first=n_w):
    """Tokens first.. of request j (a short prefill): one by one (`fetch_row`,
    `put_row`), on scratch slot `o` (its state in s_scr[o], conv window in
    win_scr[o])."""
    start = meta(START, j)
    act_row = act_scr.at[o * n_w:o * n_w + 1]

    def body(t, carry):
      pos = start + t
      x, b, a, r = fetch_row(pos)
      out = _token(st, x, b, a, prm, win_scr.at[o], act_row, bcast_scr.at[o], slot_read(o),
                   slot_write(o))
      put_row(pos, r, out)
      store(t)
      return carry

    lax.fori_loop(first, jnp.maximum(meta(LENGTH, j), first), body, 0)

  def start_reads(j):
    @when(loads(j))
    def _():
      read_conv(j).start()
      read_rec(j).start()

  _each(st, 0, st.tile, start_reads)

  first_step = pl.program_id(0) == 0
  o_tile = blk_bufs[-1] if resident else o_ref     # the tile's rows
  # Rolled: rows written at a traced index go to f32 VMEM (a dynamic sublane
  # offset into a bf16 ref is not a store Mosaic has), copied once after.
  o_rows = roll_bufs[2] if roll else o_tile
  if resident:
    @when(first_step)
    def _():
      o_ref[...] = jnp.zeros(o_ref.shape, o_ref.dtype)
  elif st.direct:
    # `o_mid` holds every token row the blocks do not, zeros where no request
    # runs, so that the op's output is the blocks plus `o_mid`: the first
    # step zeroes it (waited for before any row of it is written).
    zbuf = blk_bufs[-1]
    n = zbuf.shape[0]
    fills = [pltpu.make_async_copy(zbuf, o_mid.at[pl.ds(i, n)], blk_bufs[4].at[5])
             for i in range(0, o_mid.shape[0], n)]

    @when(first_step)
    def _():
      zbuf[...] = jnp.zeros(zbuf.shape, zbuf.dtype)
      for cp in fills:
        cp.start()

  pool_f32 = rec_ibuf.dtype == F32

  def one_token_steps():
    # One token per request (plain decode): the conv, gates and q/k of the
    # whole tile run vectorised over its requests (rows), and each new state
    # goes straight to its checkpoint buffer. The requests' GDN steps run in
    # groups of `_GROUP`: one wait for the group's state DMAs, then their
    # heads with no branch or wait between them (so the scheduler interleaves
    # them: a wait or a branch per request left every request's MXU and
    # update chain exposed, ~2x on the estimate), then the group's write-backs
    # start. Requests that do not run compute on whatever their buffers hold;
    # their rows are selected away and nothing of theirs is written back.
    wins = []
    for j in range(st.tile):
      @when(loads(j))
      def _():
        read_conv(j).wait()
      wins.append(conv_window(j))
    wins_all = jnp.stack(wins) if st.interpret else None

    def win_of(j):
      return wins[j] if isinstance(j, int) else wins_all[j]
    if st.direct and not st.all_run:
      # The block's rows are tokens base..; a request whose token is
      # elsewhere gets its rows by block DMAs.
      x_scr, b_scr, a_scr = blk_bufs[5:8]
      x_scr[...] = x_ref[...].astype(F32)
      b_scr[...] = b_ref[...].astype(F32)
      a_scr[...] = a_ref[...].astype(F32)
      def fetch_elsewhere(j):
        @pl.when(elsewhere(j))
        def _():
          x, b, a, _ = fetch_row(meta(START, j))
          x_scr[_at(j), :] = x
          b_scr[_at(j), :] = b
          a_scr[_at(j), :] = a

      _each(st, 0, st.tile, fetch_elsewhere, roll=True)
      x, b_rows, a_rows = x_scr[...], b_scr[...], a_scr[...]
    else:
      x, b_rows, a_rows = (x_ref[...].astype(F32), b_ref[...].astype(F32),
                           a_ref[...].astype(F32))
    prep = _Prepared(st, x, [jnp.concatenate([w[r:r + 1] for w in wins], axis=0)
                             for r in range(kw1)],
                     b_rows, a_rows, prm, act_scr)
    if roll:
      # The rolled loop's rows, read at a traced request index (f32 VMEM:
      # Mosaic loads one row at a dynamic sublane offset there).
      xq_scr, gate_scr = roll_bufs[0], roll_bufs[1]
      kd = st.n_kq * st.d_k
      xq_scr[0] = x
      xq_scr[1] = jnp.concatenate(prep.q + prep.k + [prep.act[:, 2 * kd:]], axis=1)
      gate_scr[0] = prep.beta
      gate_scr[1] = prep.decay

      win_of = conv_window    # (the vectorised conv's rows, again for a traced j)

      row_of = lambda ref, j: ref[pl.ds(j, 1), :]
      x_of = lambda j: row_of(xq_scr.at[0], j)
      b_of = lambda j: row_of(blk_bufs[6], j)
      a_of = lambda j: row_of(blk_bufs[7], j)
    else:
      x_of = lambda j: _take(x, j)
      b_of = lambda j: _take(b_rows, j)
      a_of = lambda j: _take(a_rows, j)

    def group_steps(group, fresh: bool):
      """The GDN steps of a group, (request, its bcast_scr slot) pairs;
      `fresh`: none of its requests reads a state (each starts from zeros:
      no read, no product with S)."""
      if not fresh:
        for j, _ in group:
          @when(loads(j))
          def _():
            read_rec(j).wait()
          zero_unread(j)
      def step(j, o):
        window = jnp.concatenate([win_of(j)[1:], x_of(j)], axis=0)
        conv_obuf[j, 0] = window.astype(conv_obuf.dtype)

        def s_write(h, s, j=j):
          rec_obuf[j, 0, h] = s.astype(rec_obuf.dtype)

        if roll:
          p, row = _Row(st, row_of(xq_scr.at[1], j), row_of(gate_scr.at[0], j),
                        row_of(gate_scr.at[1], j)), 0
        else:
          p, row = prep, j
        out = _heads(st, p, row, bcast_scr.at[o], None if fresh else first_read(j), s_write)
        if not st.all_run:
          out = jnp.where(runs(j), out, 0.0)
        o_rows[_at(j), :] = out.astype(o_rows.dtype)

      if roll:
        for j, o in group:
          step(j, o)
      else:
        _each(st, group[0][0], group[-1][0] + 1, lambda j: step(j, j))

    def run_group(group):
      if st.all_run:
        group_steps(group, fresh=not st.all_init)
      else:
        any_read = functools.reduce(jnp.logical_or, [loads(j) for j, _ in group])
        pl.when(any_read)(lambda: group_steps(group, fresh=False))
        fresh = jnp.logical_not(any_read)
        if st.skips_idle:
          # A group none of whose requests runs computes nothing: its rows
          # are zeros, as a running group's idle requests' are.
          any_run = any_runs([j for j, _ in group])
          fresh = jnp.logical_and(any_run, fresh)

          @pl.when(jnp.logical_not(any_run))
          def _():
            for j, _ in group:
              o_rows[_at(j), :] = jnp.zeros((1, o_rows.shape[1]), o_rows.dtype)
        pl.when(fresh)(lambda: group_steps(group, fresh=True))

      def finish(j, o):
        if st.mid_tokens and not st.all_run:
          # A short prefill (more than one token): token 0 again, token by
          # token from here, keeping the state in float32 between tokens.
          @pl.when(jnp.logical_and(runs(j), meta(LENGTH, j) > 1))
          def _():
            zero_unread(j)      # (a fresh group's steps left it unread)
            win_scr[0] = win_of(j)
            o_rows[_at(j), :] = _token(
                st, x_of(j), b_of(j), a_of(j), prm, win_scr.at[0], act_scr.at[0:1],
                bcast_scr.at[o], first_read(j), slot_write(0)).astype(o_rows.dtype)

            def store(t):
              del t   # short prefills keep only their final state

            mid_tokens(j, store)
            conv_obuf[j, 0] = win_scr[0].astype(conv_obuf.dtype)
            _store_state(s_scr.at[0], rec_obuf.at[j, 0])

        if st.direct and not st.all_run:
          # Its first token's output row goes where the token is.
          @pl.when(elsewhere(j))
          def _():
            pos = meta(START, j)
            _, _, _, r = fetch_row(pos)
            put_row(pos, r, o_rows[_at(j), :].astype(F32))
            o_rows[_at(j), :] = jnp.zeros((1, o_rows.shape[1]), o_rows.dtype)

        @when(runs(j))
        def _():
          for cp in writes(j, 0):
            cp.start()

      if roll:
        for j, o in group:
          finish(j, o)
      else:
        _each(st, group[0][0], group[-1][0] + 1, lambda j: finish(j, j))

    if roll:
      # `rolled` requests per iteration: one wait for their state reads, then
      # their steps with no branch between them (as a group's, below).
      def iteration(i, carry):
        j0 = i * st.rolled
        run_group([(j0 + o, o) for o in range(st.rolled)])
        return carry

      lax.fori_loop(0, st.tile // st.rolled, iteration, 0)
      o_tile[...] = o_rows[...].astype(o_tile.dtype)
    else:
      for g0 in range(0, st.tile, _GROUP):
        run_group([(j, j) for j in range(g0, min(g0 + _GROUP, st.tile))])

    if resident:
      # Rows base.. of the output: request j's row where it runs and its token
      # is there; others keep what the other requests' steps wrote there.
      n = min(_BLOCK, st.tile)    # (a tile of 8 is a single grid step: base 0)
      for c in range(0, st.tile, n):
        rows = pl.ds(pl.multiple_of(base + c, n), n)
        mine = o_tile[c:c + n, :].astype(F32)
        if not st.all_run:
          iota = lax.broadcasted_iota(jnp.int32, (n, 1), 0)
          home = jnp.zeros((n, 1), jnp.int32)
          for k in range(n):
            here = jnp.logical_and(runs(c + k), jnp.logical_not(elsewhere(c + k)))
            home = jnp.where(iota == k, here.astype(jnp.int32), home)
          mine = jnp.where(home > 0, mine, o_ref[rows, :].astype(F32))
        o_ref[rows, :] = mine.astype(o_ref.dtype)

  def window_steps():
    o_rows[...] = jnp.zeros(o_rows.shape, o_rows.dtype)

    def window_group(group):
      """`window_steps_of(group)`, skipped where none of the group's
      requests runs (its output rows stay zero)."""
      if st.skips_idle:
        pl.when(any_runs([j for j, _ in group]))(lambda: window_steps_of(group))
      else:
        window_steps_of(group)

    def window_steps_of(group):
      """The verify windows (or first `window` tokens) of a group of requests,
      (request, its scratch slot) pairs, each window at once (`_Window`), with
      no branch or wait between the group's requests. Every request computes
      every token of the window; a token at or past its length, or of a
      request that does not run, computes on whatever its rows hold (later
      tokens never reach earlier ones), and its output row is selected away
      and its checkpoint lands in a buffer no DMA writes back (c >=
      checkpoints; c < 0 lands in buffer 0, which the request's real first
      checkpoint, a later token, overwrites)."""
      for j, o in group:
        @when(loads(j))
        def _():
          read_conv(j).wait()
          read_rec(j).wait()
        zero_unread(j)

      wins = []
      for j, o in group:
        if st.all_run:
          length = n_w
          ckpt = lambda t: t
        else:
          length = meta(LENGTH, j)
          ckpt = functools.partial(window_checkpoint, length=length,
                                   checkpoints=meta(CHECKPOINTS, j), window=n_w)

        def s_write(h, t, rows, s, j=j, ckpt=ckpt):
          rec_obuf[j, ckpt(t), h, rows] = s.astype(rec_obuf.dtype)

        def conv_write(t, w, j=j, ckpt=ckpt):
          conv_obuf[j, ckpt(t)] = w.astype(conv_obuf.dtype)

        wins.append((j, length, s_write, _Window(
            st, *window_rows(j), conv_window(j), prm, act_scr.at[o * n_w:(o + 1) * n_w],
            k_scr.at[o], conv_write)))
      # Phase by phase over the group's requests and heads (`_Window`).
      for j, _, _, w in wins:
        for h in w.heads():
          w.products(h, first_read(j)(h))
      for j, length, s_write, w in wins:
        out = jnp.concatenate([w.solve(h) for h in w.heads()], axis=1)
        for i in range(st.n_kq):
          w.checkpoints(i, lambda h, rows, j=j: rec_ibuf[j, h, rows], s_write)
        if not st.all_run:
          live = lax.broadcasted_iota(jnp.int32, (n_w, 1), 0) < length
          out = jnp.where(live, out, 0.0)
        put_window(j, out)

      for j, o in group:
        if st.mid_tokens and not st.all_run:
          @when(jnp.logical_and(runs(j), meta(LENGTH, j) > n_w))
          def _():
            # A short prefill longer than the window: token by token from its
            # first token again (block DMAs), keeping its state in float32.
            length, ckpts = meta(LENGTH, j), meta(CHECKPOINTS, j)
            win_scr[o] = conv_window(j)
            _store_state(rec_ibuf.at[j], s_scr.at[o])

            def store(t):
              """Checkpoint after token t: slot c = t - (length - ckpts), if c >= 0."""
              c = t - (length - ckpts)

              @when(c >= 0)
              def _():
                conv_obuf[j, c] = win_scr[o].astype(conv_obuf.dtype)
                _store_state(s_scr.at[o], rec_obuf.at[j, c])

            mid_tokens(j, store, o, first=0)

        for c in range(n_w):
          @when(writes_ckpt(j, c))
          def _():
            for cp in writes(j, c):
              cp.start()

    if roll:
      # A request's rows at a traced index: from f32 copies, one (window, L)
      # slab per request (a slab at a leading index is an aligned load and
      # store, rows j * window.. of one array are not where window < 8).
      x_win, gate_win, o_win = roll_bufs
      for j in range(st.tile):
        rows = slice(j * n_w, (j + 1) * n_w)
        x_win[j] = x_ref[rows, :].astype(F32)
        gate_win[0, j] = b_ref[rows, :].astype(F32)
        gate_win[1, j] = a_ref[rows, :].astype(F32)

      def window_rows(j):
        return x_win[j], gate_win[0, j], gate_win[1, j]

      def put_window(j, out):
        o_win[j] = out
    else:
      def window_rows(j):
        rows = (slice(j * n_w, (j + 1) * n_w) if isinstance(j, int)
                else pl.ds(j * n_w, n_w))     # (interpret mode)
        return tuple(r[rows, :].astype(F32) for r in (x_ref, b_ref, a_ref))

      def put_window(j, out):
        rows = slice(j * n_w, (j + 1) * n_w) if isinstance(j, int) else pl.ds(j * n_w, n_w)
        o_tile[rows, :] = out.astype(o_tile.dtype)
    n_g = state_slots(st)
    if roll or st.interpret:
      def iteration(i, carry):
        window_group([(i * n_g + o, o) for o in range(n_g)])
        return carry

      lax.fori_loop(0, st.tile // n_g, iteration, 0)
    else:
      for j0 in range(0, st.tile, n_g):
        window_group([(j0 + o, o) for o in range(n_g)])
    if roll:
      for j in range(st.tile):
        o_tile[j * n_w:(j + 1) * n_w, :] = o_win[j].astype(o_tile.dtype)

  steps = one_token_steps if n_w == 1 else window_steps
  if not st.skips_idle:
    steps()
  else:
    # A tile none of whose requests runs here (the padding of a batch
    # padded to its maximum size) reads, computes and writes nothing: its
    # output rows are zeros where they are the tile's own block, untouched
    # where the output stays in VMEM (zeroed by the first step).
    tile_runs = any_runs(range(st.tile))
    pl.when(tile_runs)(steps)
    if not resident:
      @pl.when(jnp.logical_not(tile_runs))
      def _():
        o_tile[...] = jnp.zeros(o_tile.shape, o_tile.dtype)

  if st.direct and not resident:
    @when(first_step)
    def _():
      for cp in fills:
        cp.wait()
  def wait_writes(j):
    for c in range(n_w):
      @when(writes_ckpt(j, c))
      def _():
        for cp in writes(j, c):
          cp.wait()

  _each(st, 0, st.tile, wait_writes)


def padded_requests(st: DecodeStatic) -> int:
  """R_padded: the requests the grid covers (R rounded up to whole tiles)."""
  return -(-st.num_requests // st.tile) * st.tile


def decode(index, xs, bs, as_, taps, bias, a_log, dt_bias, conv_pool, rec_pool, qkv=None,
           b=None, a=None, *, st: DecodeStatic, interpret=False, vmem_limit_bytes=None):
  """Runs the decode kernel over R_padded = `padded_requests(st)` requests
  (the tiles of them `grid_steps` visits).

  index: the call's int32 index arrays (query_start_loc [R + 1],
    state_indices, distribution [3], seq_lens, then read_state_indices and
    read_offsets [R] where `st.has_reads` / `st.has_offsets`); the kernel
    derives each request's metadata from them. xs [R_padded * window, D],
    bs / as_ [R_padded * window, Hv]: each request's first `window` tokens
    (row r * window + t); with `st.direct`, None (the kernel's blocks are
    the token arrays qkv, b, a: row r is request r's token where its start
    is r). taps [W, D] (tap w multiplies the input W-1-w back), bias [1, D]
    (None where not `st.has_bias`), a_log and dt_bias [1, Hv], in their
    dtypes. With `st.mid_tokens`, qkv / b / a are the whole [T, ...] arrays
    (rows past the window are read from there).

  Returns (out [R_padded * window, Hv V] in the activations' dtype, out_mid
  [T, Hv V] or None, conv_pool, rec_pool) with the pools updated in place.
  out_mid holds the rows of tokens past a request's window (other rows
  undefined); with `st.direct`, every token row that is not `out`'s own
  (row t of `out` is request t's token if that request runs and starts at
  t, else zero) and zeros where no request runs, so that the output is
  out + out_mid. With `st.resident_rows`, out is the whole output
  [resident_rows, Hv V] (token rows first, zeros where no request runs) and
  out_mid is None.
  """
  r_pad = padded_requests(st)
  tile, n_w, dim, hv = st.tile, st.window, st.dim, st.n_v
  n_idx = _n_index(st)
  assert len(index) == n_idx
  block = lambda width: pl.BlockSpec((tile * n_w, width), lambda i, *_: (i, 0))
  full = lambda *shape: pl.BlockSpec(shape, lambda i, *_: (0,) * len(shape))
  anyspace = pl.BlockSpec(memory_space=pl.ANY)
  t_len = 0 if qkv is None else qkv.shape[0]
  t_pad = -(-t_len // _BLOCK) * _BLOCK
  # Padded to whole _BLOCK-row blocks (the mid tokens' aligned DMAs) and, in
  # direct mode, to at least one row per request (the blocks).
  n_rows = max(t_pad, r_pad) if st.direct else t_pad
  pad = lambda x: x if x.shape[0] == n_rows else jnp.pad(x, ((0, n_rows - x.shape[0]), (0, 0)))
  if st.direct:
    assert st.mid_tokens and n_w == 1
    xs, bs, as_ = pad(qkv), pad(b), pad(a)
  params = [taps] + ([bias] if st.has_bias else []) + [a_log, dt_bias]
  in_specs = [block(dim), block(hv), block(hv)] + [full(*x.shape) for x in params]
  args = [xs, bs, as_] + params
  if st.mid_tokens:
    in_specs += [anyspace] * 3
    args += [xs, bs, as_] if st.direct else [pad(x) for x in (qkv, b, a)]
  in_specs += [anyspace, anyspace]
  # The pools stay in HBM, pinned: XLA otherwise moves small ones into VMEM
  # beside the kernel's own buffers (on v5e a 65-slot TP8 pool ran the
  # compile out of scoped VMEM), and only the DMAs touch them anyway.
  conv_pool, rec_pool = (pltpu.with_memory_space_constraint(x, pltpu.HBM)
                         for x in (conv_pool, rec_pool))
  args += [conv_pool, rec_pool]
  out_dtype = xs.dtype
  resident = st.resident_rows > 0
  if resident:
    assert st.direct and st.resident_rows == n_rows
    assert st.tile % _BLOCK == 0 or st.tile == r_pad, "resident rows move in whole blocks"
    out_specs = [full(n_rows, hv * st.d_v)]
    out_shape = [jax.ShapeDtypeStruct((n_rows, hv * st.d_v), out_dtype)]
  else:
    out_specs = [block(hv * st.d_v)]
    out_shape = [jax.ShapeDtypeStruct((r_pad * n_w, hv * st.d_v), out_dtype)]
  if st.mid_tokens and not resident:
    out_specs.append(anyspace)
    out_shape.append(pltpu.HBM((t_pad, hv * st.d_v), out_dtype))
  out_specs += [anyspace, anyspace]
  out_shape += [jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                jax.ShapeDtypeStruct(rec_pool.shape, rec_pool.dtype)]
  n_in = n_idx + len(args)        # + the scalar-prefetch operands
  aliases = {n_in - 2: len(out_shape) - 2, n_in - 1: len(out_shape) - 1}
  kw1 = st.kernel_size - 1
  scratch = [
      pltpu.VMEM((tile, kw1, dim), conv_pool.dtype),
      pltpu.VMEM((tile, hv, st.d_k, st.d_v), rec_pool.dtype),
      pltpu.VMEM((tile, n_w, kw1, dim), conv_pool.dtype),
      pltpu.VMEM((tile, n_w, hv, st.d_k, st.d_v), rec_pool.dtype),
      pltpu.VMEM((state_slots(st), kw1, dim), F32),
      pltpu.VMEM((tile if n_w == 1 else state_slots(st) * n_w, dim), F32),
      pltpu.VMEM((_bcast_slots(st), 2, st.d_k, st.d_v), F32),
      pltpu.VMEM((state_slots(st), hv, st.d_k, st.d_v), F32),
      pltpu.SemaphoreType.DMA((2, tile)),
      pltpu.SemaphoreType.DMA((2, tile, n_w)),
      pltpu.SMEM((_META, tile), jnp.int32),
  ]
  if n_w > 1:   # `_Window`'s key columns, per request in flight
    scratch.append(pltpu.VMEM((state_slots(st), st.n_kq, st.d_k, -(-n_w // _ROWS) * _ROWS),
                              F32))
  if st.rolled:
    assert tile % st.rolled == 0, (tile, st.rolled)
    # The rolled loop's f32 rows: n_w = 1: [x; q | k | v], [beta; decay]
    # (the prepared tile), and the output rows; else per request x, [b; a]
    # and the output (window, L).
    if n_w == 1:
      scratch += [pltpu.VMEM((2, tile, dim), F32), pltpu.VMEM((2, tile, hv), F32),
                  pltpu.VMEM((tile, hv * st.d_v), F32)]
    else:
      scratch += [pltpu.VMEM((tile, n_w, dim), F32), pltpu.VMEM((2, tile, n_w, hv), F32),
                  pltpu.VMEM((tile, n_w, hv * st.d_v), F32)]
  if st.mid_tokens:
    scratch += [pltpu.VMEM((_BLOCK, dim), qkv.dtype), pltpu.VMEM((_BLOCK, hv), b.dtype),
                pltpu.VMEM((_BLOCK, hv), a.dtype), pltpu.VMEM((_BLOCK, hv * st.d_v), out_dtype),
                pltpu.SemaphoreType.DMA((6,))]
  if st.direct:
    scratch += [pltpu.VMEM((tile, dim), F32), pltpu.VMEM((tile, hv), F32),
                pltpu.VMEM((tile, hv), F32),
                pltpu.VMEM((tile if resident else _fill_rows(t_pad), hv * st.d_v), out_dtype)]
  res = pl.pallas_call(
      functools.partial(_kernel, st=dataclasses.replace(st, interpret=True) if interpret else st),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=n_idx, grid=(grid_steps(st, index, t_len),), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                           vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
      name="gdn_serve_decode",
  )(*index, *args)
  if resident:
    (out, conv_pool, rec_pool), out_mid = res, None
  elif st.mid_tokens:
    out, out_mid, conv_pool, rec_pool = res
    out_mid = out_mid if t_pad == t_len else out_mid[:t_len]
  else:
    (out, conv_pool, rec_pool), out_mid = res, None
  return out, out_mid, conv_pool, rec_pool


def grid_steps(st: DecodeStatic, index, t_len: int):
  """The grid's steps: one per tile of requests, R_padded / tile; in direct
  mode, where tiles lie wholly past the call's token rows, as many as the
  valid requests and the token rows need (traced: a dynamic grid).

  Only the tiles holding valid requests (r < distribution[2]) can run, and
  in direct mode only the first ceil(T / tile) tiles' output rows are the
  op's: a batch padded to a bucket of requests (64 of 512) visits its 8
  tiles, not 64, where a grid step that skips its tile still pays for its
  pipeline step and block copies (docs/performance.md, "chip-serving-padded"). Static where no tile lies past the token rows (a full
  decode batch: no scalar op before the kernel), for the cost model, and
  without `skip_idle`."""
  steps = padded_requests(st) // st.tile
  lo = max(1, -(-t_len // st.tile))
  if not st.direct or not st.skips_idle or lo >= steps:
    return steps
  valid = jnp.clip(index[2][2], 0, st.num_requests)
  return jnp.clip((valid + st.tile - 1) // st.tile, lo, steps).astype(jnp.int32)


def _store_state(src, dst) -> None:
  """dst[...] = src[...] (f32 [Hv, K, V] to the pool's dtype), one head at a
  time, so the cast needs no f32 state-sized temporary (4 MiB at 64 heads).
  `vmem_bytes` still counts two f32 states of margin: the chip needed them
  (dp8_ep8_prefill_512)."""
  def body(h, carry):
    dst[h] = src[h].astype(dst.dtype)
    return carry
  lax.fori_loop(0, src.shape[0], body, 0)


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


def _bcast_slots(st: DecodeStatic) -> int:
  """Lane-broadcast buffers (`_heads`): one per request whose steps are
  traced together."""
  return (st.rolled or st.tile) if st.window == 1 else state_slots(st)


def _fill_rows(t_pad: int) -> int:
  """Rows of the zero block direct mode fills `out_mid` with (a divisor of
  t_pad, a multiple of _BLOCK, at most 256)."""
  n = min(t_pad, 256)
  while t_pad % n:
    n -= _BLOCK
  return n


def vmem_bytes(st: DecodeStatic, pool_itemsize: int, act_itemsize: int) -> int:
  """Scoped VMEM of one grid step: the state buffers (in + `window` out per
  request), the double-buffered activation blocks, f32 scratch; plus a
  margin for Mosaic's temporaries (one f32 state and the conv rows)."""
  state = st.n_v * st.d_k * st.d_v
  conv = (st.kernel_size - 1) * st.dim
  bufs = st.tile * (1 + st.window) * (state + conv) * pool_itemsize
  acts = 2 * 2 * st.tile * st.window * (st.dim + 2 * st.n_v + st.n_v * st.d_v) * act_itemsize
  bcast = _bcast_slots(st) * 2 * st.d_k * st.d_v
  rows = st.tile * (st.dim + 2 * st.n_v) if st.direct else 0   # direct mode's f32 rows
  if st.rolled:   # the rolled loop's f32 rows (`decode`'s scratch)
    n = st.tile * st.window
    rows += n * ((2 if st.window == 1 else 1) * st.dim + 2 * st.n_v + st.n_v * st.d_v)
  if st.window > 1:   # `_Window`'s key columns (laid out in whole 128 lanes)
    bcast += state_slots(st) * st.n_kq * st.d_k * 128 * -(-st.window // 128)
  scratch = 4 * (state_slots(st) * (state + conv + st.window * st.dim) + bcast + rows)
  out_row = st.n_v * st.d_v * act_itemsize
  if st.resident_rows:
    outs = (2 * st.resident_rows + st.tile) * out_row
  elif st.direct:
    outs = _fill_rows(-(-st.num_tokens // _BLOCK) * _BLOCK) * out_row
  else:
    outs = 0
  # Mosaic's temporaries, two f32 states: a margin that held on the chip
  # (dp8_ep8_prefill_512, 64 heads: Mosaic allocated 55.1 MiB where this
  # estimates 55.9; with two heads instead of two states, 48.1); as much
  # again for each further request whose window runs interleaved.
  return bufs + acts + scratch + outs + 2 * 4 * state * state_slots(st) + (4 << 20)
