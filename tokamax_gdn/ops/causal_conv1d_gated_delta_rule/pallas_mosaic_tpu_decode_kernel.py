"""The serving decode kernel's body: request metadata, state DMAs, the loops
over a tile's requests.

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
over its requests; then the GDN steps run in groups of `GROUP` requests: one
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
request of the tile is traced, in groups of `GROUP`.

Windows of several tokens (`window_group`) loop over the tile's requests the
same way, n per iteration, each window's tokens at once (`Window`: the
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

The arithmetic of a token's step and of a window is in
`pallas_mosaic_tpu_decode_step.py`; the call that runs this body (blocks,
scratch, grid) in `pallas_mosaic_tpu_decode.py`.
"""

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_decode_static import (  # pylint: disable=g-importing-member
    BLOCK_ROWS, CHECKPOINTS, DecodeStatic, GROUP, HAS_INIT, LENGTH, READ_SLOT, START,
    WRITE_SLOT, n_index, state_slots, window_checkpoint)
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_decode_step import (  # pylint: disable=g-importing-member
    Params, Prepared, Row, Window, step_heads, take, token_step)

F32 = jnp.float32


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


def _pick_row(block, r):
  """Row r (traced) of a (BLOCK_ROWS, L) float32 block, as (1, L), by a masked sum
  (a dynamic sublane offset is not a vector load Mosaic has for every dtype)."""
  rows = lax.broadcasted_iota(jnp.int32, block.shape, 0)
  return jnp.sum(jnp.where(rows == r, block, 0.0), axis=0, keepdims=True)


def kernel(*refs, st: DecodeStatic):
  refs = list(refs)
  idx = refs[:n_index(st)]
  refs = refs[n_index(st):]
  x_ref, b_ref, a_ref, taps_ref = refs[:4]
  refs = refs[4:]
  bias_ref = refs.pop(0) if st.has_bias else None
  prm = Params(taps_ref, bias_ref, refs.pop(0), refs.pop(0))
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
    """Token `pos`'s (x, b, a) rows (1, ...) float32, from aligned BLOCK_ROWS-row
    blocks of the padded [T, ...] arrays; also loads `o_mid`'s block of it
    for `put_row`. Returns (x, b, a, r): r is pos's row in its block."""
    x_blk, b_blk, a_blk, o_blk, sem_blk = blk_bufs[:5]
    blk = pl.multiple_of((pos // BLOCK_ROWS) * BLOCK_ROWS, BLOCK_ROWS)
    rows = pl.ds(blk, BLOCK_ROWS)
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
    blk = pl.multiple_of((pos // BLOCK_ROWS) * BLOCK_ROWS, BLOCK_ROWS)
    sel = lax.broadcasted_iota(jnp.int32, o_blk.shape, 0) == r
    if resident:
      rows = pl.ds(blk, BLOCK_ROWS)
      o_ref[rows, :] = jnp.where(sel, out, o_ref[rows, :].astype(F32)).astype(o_ref.dtype)
      return
    o_blk[...] = jnp.where(sel, out, o_blk[...].astype(F32)).astype(o_blk.dtype)
    cp = pltpu.make_async_copy(o_blk, o_mid.at[pl.ds(blk, BLOCK_ROWS)], sem_blk.at[4])
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
      out = token_step(st, x, b, a, prm, win_scr.at[o], act_row, bcast_scr.at[o], slot_read(o),
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
    # groups of `GROUP`: one wait for the group's state DMAs, then their
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
    prep = Prepared(st, x, [jnp.concatenate([w[r:r + 1] for w in wins], axis=0)
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
      x_of = lambda j: take(x, j)
      b_of = lambda j: take(b_rows, j)
      a_of = lambda j: take(a_rows, j)

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
          p, row = Row(st, row_of(xq_scr.at[1], j), row_of(gate_scr.at[0], j),
                        row_of(gate_scr.at[1], j)), 0
        else:
          p, row = prep, j
        out = step_heads(st, p, row, bcast_scr.at[o], None if fresh else first_read(j), s_write)
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
            o_rows[_at(j), :] = token_step(
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
      for g0 in range(0, st.tile, GROUP):
        run_group([(j, j) for j in range(g0, min(g0 + GROUP, st.tile))])

    if resident:
      # Rows base.. of the output: request j's row where it runs and its token
      # is there; others keep what the other requests' steps wrote there.
      n = min(BLOCK_ROWS, st.tile)    # (a tile of 8 is a single grid step: base 0)
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
      (request, its scratch slot) pairs, each window at once (`Window`), with
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

        wins.append((j, length, s_write, Window(
            st, *window_rows(j), conv_window(j), prm, act_scr.at[o * n_w:(o + 1) * n_w],
            k_scr.at[o], conv_write)))
      # Phase by phase over the group's requests and heads (`Window`).
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


def _store_state(src, dst) -> None:
  """dst[...] = src[...] (f32 [Hv, K, V] to the pool's dtype), one head at a
  time, so the cast needs no f32 state-sized temporary (4 MiB at 64 heads).
  `vmem_bytes` still counts two f32 states of margin: the chip needed them
  (dp8_ep8_prefill_512)."""
  def body(h, carry):
    dst[h] = src[h].astype(dst.dtype)
    return carry
  lax.fori_loop(0, src.shape[0], body, 0)
