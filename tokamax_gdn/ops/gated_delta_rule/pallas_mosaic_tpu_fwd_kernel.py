"""The forward Pallas GDN kernel: one grid step per (batch row, chunk).

`fwd_kernel` picks how the chunk enters and leaves the state (initial state,
per-segment codes, or a serving work item), `_fwd_step` loads and stores the
state, `_fwd_chunk` computes the chunk's outputs and the state update with
the factored-beta WY form, head groups stage-major. Algebra: `docs/gdn_math.md`
("Forward"); TPU design: `docs/gdn_pallas_tpu.md`.
"""

import functools

from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops import numerics
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_gates as gates
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_guard as guard
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_inverse as inverse
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kernel_prologue

F32, BF16 = jnp.float32, jnp.bfloat16


def fwd_kernel(*refs, names: tuple[str, ...], st: common.Static, write_out: bool, emit: bool):
  r = common.Refs(names, refs)
  code_ref, c_idx = r.code, pl.program_id(1)

  rows = init = run = None
  if st.requests:     # a work item (`requests._item_table`)
    flags = r.item_flags[c_idx]
    run = (flags & 1) == 1
    enter, leave, init = common.flag(flags, 1), common.flag(flags, 2), common.flag(flags, 3)
    rows = (lax.shift_right_logical(flags, jnp.int32(4)) & 255,
            lax.shift_right_logical(flags, jnp.int32(12)) & 255)

    @pl.when(common.flag(flags, 20))
    def _fresh():
      # The first item of its block: the block's rows start as `base`'s (the
      # output updates `base` in place; items merge their rows into it).
      r.out[...] = r.base[...]
  elif st.n_states:   # a segment starts here: its own state (zeros from segment N on)
    code = code_ref[pl.program_id(0) * pl.num_programs(1) + c_idx]
    enter, leave = common.code_reset(code) == 1, common.code_last(code) == 1
  else:
    enter, leave = c_idx == 0, c_idx == pl.num_programs(1) - 1

  if not st.gated:
    run = None
  _fwd_step(r, st, write_out, emit, enter, leave, init, rows, run)



def _fwd_step(r: common.Refs, st: common.Static, write_out: bool, emit: bool, enter, leave, init, rows,
              run):
  """One chunk of `fwd_kernel`: `enter`/`leave` (scalars) take the
  initial state / write the final one; with `requests`, `init` says whether
  the initial state is the request's read state (else zeros) and only the
  block's rows [lo, hi) = `rows` are the request's (the others pass the
  state through, and their output rows are left as they are); `run` (None:
  always) gates the whole step. The gate is folded into each branch rather
  than put around them: the state DMAs in a branch nested in another made
  libtpu's static estimator abort ("No DMA issue node found for sync
  flag")."""
  h0_ref, s_scr, c_idx = r.h0, r.s, pl.program_id(1)
  if run is not None:
    enter, leave = jnp.logical_and(run, enter), jnp.logical_and(run, leave)

  @pl.when(enter)
  def _init():
    if st.guard:
      guard.guard_enter(h0_ref if st.has_h0 else None, s_scr, r.guard_carry, st)
    elif init is None:
      s_scr[...] = h0_ref[...].astype(F32) if st.has_h0 else jnp.zeros(s_scr.shape, F32)
    else:
      # `requests`: the request's read slot of the pool (HBM) by a DMA here,
      # and a select, so a NaN in an unread slot stays out. (As pipelined
      # blocks with SMEM index maps, the state in and out made libtpu's
      # static estimator abort: "No DMA issue node found for sync flag".)
      cp = pltpu.make_async_copy(h0_ref.at[r.item_slot[c_idx]], r.h0_buf, r.sem.at[0])
      cp.start()
      cp.wait()
      s_scr[...] = jnp.where(init, r.h0_buf[...].astype(F32), 0.0)

  if run is None:
    _fwd_chunk(r, st, write_out, emit, rows)
  else:
    pl.when(run)(lambda: _fwd_chunk(r, st, write_out, emit, rows))

  if init is None and r.final is None:   # no final state asked for
    return

  @pl.when(leave)
  def _final():
    if st.guard:
      guard.guard_state_out(r.final, s_scr, r.guard_carry)
    elif init is None:
      r.final[...] = r.s[...]
    else:   # `requests`: into the request's write slot of the pool, by a DMA
      r.h0_buf[...] = r.s[...].astype(r.h0_buf.dtype)
      cp = pltpu.make_async_copy(r.h0_buf, r.pool.at[r.item_write[c_idx]], r.sem.at[1])
      cp.start()
      cp.wait()


def _fwd_chunk(r: common.Refs, st: common.Static, write_out: bool, emit: bool, rows):
  """`_fwd_step`'s compute: the chunk's outputs and the state update."""
  q_ref, k_ref, v_ref, g_ref, b_ref = r.q, r.k, r.v, r.log_decay, r.beta
  st_ref, o_ref = r.starts, r.out
  states_ref, tm_ref = r.states, r.tmats
  s_scr, rows_scr, qh_scr, kh_scr, vh_scr, out_scr = r.s, r.rows, r.qh, r.kh, r.vh, r.out_heads
  c, c_idx = st.chunk, pl.program_id(1)
  dim_k = st.dim_k
  dot = functools.partial(numerics.mxu, passes=st.passes, v5e_forms=st.v5e_forms)
  poison_ref = (r.guard_rows if st.guard else r.poison) if write_out else None
  gate, masks = kernel_prologue.step_prologue(g_ref, b_ref, st_ref, rows_scr, st, c_idx, rows,
                               kernel_prologue.gate_params(r))
  _, strict = masks
  # With `sanitize` the keys and values are sanitised per head in `group` (a
  # NaN would reach earlier tokens through 0-coefficients; a select over a
  # whole block took scoped VMEM past the tpu7x limit). A query reaches only
  # its own output, so it stays as it is.
  if st.packed:
    kernel_prologue.packed_heads(r.qkv, b_ref, qh_scr, kh_scr, vh_scr, st, c_idx, rows)
  else:
    # The states pass (no outputs) reads no queries: they reach the outputs
    # only (the states pass skips their norm and half of [Q; K] Kᵀ). Without
    # a scratch copy (`common.head_copies`) the head groups read q, k, v
    # from their blocks.
    qh_scr, kh_scr, vh_scr = (
        common.head_tiles(ref, scr, d, st, c_idx)
        for ref, scr, d in ((q_ref, qh_scr, dim_k), (k_ref, kh_scr, dim_k), (v_ref, vh_scr, st.dim_v)))
  if st.qk_l2norm and st.qk_in_place:
    def normalise(j, carry):
      if write_out:
        qh_scr[j] = kernel_prologue.normed(qh_scr[j], st)[0]
      kh_scr[j] = kernel_prologue.normed(kh_scr[j], st)[0]
      return carry

    lax.fori_loop(0, st.hk, normalise, 0)
  if st.guard:
    guard.guard_fwd_rows(r, st, gate, masks[0], c_idx, write_out, emit, kh_scr, vh_scr)
  if poison_ref is not None:
    c_iota = lax.broadcasted_iota(jnp.int32, (c, c), 0)
    diag = c_iota == lax.broadcasted_iota(jnp.int32, (c, c), 1)

  def prepare(gi):
    """A head group's state-independent part up to A' (the inverse's input)."""
    heads, kheads = common.group_heads(st, gi)
    kj = lambda u: u // st.group
    norm = (lambda x: x) if st.qk_in_place else (lambda x: kernel_prologue.normed(x, st)[0])
    q = {ku: norm(qh_scr[j]) for ku, j in kheads.items()} if write_out else None
    k = {ku: common.finite(norm(guard.guard_finite(kh_scr[j], st)), st) for ku, j in kheads.items()}
    beta = {u: common.head_row(rows_scr, kernel_prologue.BETA, i) for u, i in heads.items()}
    # Γ and decay_in from the compensated G for float32 inputs; for bfloat16
    # inputs from its float32 part alone, as in the backward (`bwd_kernel`,
    # docs/gdn_math.md "The compensated cumsum"): one transpose (XLU) and three vector
    # passes less per head.
    gammas, dins = {}, {}
    for u, i in heads.items():
      g_lo = common.head_row(rows_scr, kernel_prologue.G_LO, i) if st.passes > 1 else None
      gammas[u], dins[u] = gates.gamma_decay_in(
          (common.head_row(rows_scr, kernel_prologue.G_HI, i), g_lo, gate.run), masks, dim_k)
    qkk = {ku: dot(jnp.concatenate([q[ku], k[ku]], 0) if write_out else k[ku], k[ku], tb=True)
           for ku in kheads}                               # [Q; K] Kᵀ, or K Kᵀ
    kk = lambda ku: qkk[ku][c:] if write_out else qkk[ku]
    # Γ ⊙ β_j once for A' and P̃
    gbs = {u: gammas[u] * beta[u] for u in heads}
    a_list = [jnp.where(strict, kk(kj(u)) * gbs[u], 0.0) for u in heads]
    return dict(q=q, k=k, dins=dins, qkk=qkk, gbs=gbs, a_list=a_list)

  def finish(gi, pre, t_list):
    """A head group's outputs and state update, given its T' = (I + M D_β)⁻¹."""
    heads, kheads = common.group_heads(st, gi)
    kj = lambda u: u // st.group
    q, k, dins, qkk, gbs = (pre[n] for n in ("q", "k", "dins", "qkk", "gbs"))
    tmats = dict(zip(heads, t_list))        # (T' or T'ᵀ, transposed)
    v = {u: common.finite(guard.guard_finite(vh_scr[i], st), st) for u, i in heads.items()}
    s = {u: s_scr[i] for u, i in heads.items()}
    # V″ = Ũ − W̃ S = T' (V − K_in S): the forward needs no W̃, so two
    # products, not three, and the first does not wait for the inverse.
    x_in = {u: v[u] - dot(k[kj(u)] * dins[u], s[u]) for u in heads}   # V − K_in S
    v_new = {u: dot(tmats[u][0], x_in[u], ta=tmats[u][1]) for u in heads}   # V″
    if write_out:
      for u, i in heads.items():
        p_tilde = qkk[kj(u)][:c] * gbs[u]
        if poison_ref is not None:
          # NaN on the diagonal of a poisoned token's row: it meets that
          # token's own V″ row only, so exactly its output turns NaN (a
          # column row, a sublane broadcast; a per-row select of the output
          # would be a lane broadcast).
          p_tilde = guard.poison_diag(p_tilde, poison_ref[pl.ds(i, 1), :], diag, st)
        lhs = common.operand_cat([q[kj(u)] * dins[u], p_tilde], 1, st)
        rhs = common.operand_cat([s[u], v_new[u]], 0, st)
        out_scr[i] = st.scale * dot(lhs, rhs)
    k_t = {ku: k[ku].T for ku in kheads}
    for u, i in heads.items():
      lam = common.head_row(rows_scr, kernel_prologue.DECAY_CHUNK, i)[:, 0:1]
      s_scr[i] = lam * s[u] + dot(k_t[kj(u)] * common.head_row(rows_scr, kernel_prologue.KOUT, i), v_new[u])
      if emit:
        states_ref[i] = common.residual(s[u], states_ref, st)
        tm_ref[i] = common.stored_tmat(*tmats[u], tm_ref, st, u)

  invert = functools.partial(inverse.invert_unit_lower, newton=st.newton, v5e_forms=st.v5e_forms)
  if st.unroll_groups is True:
    # Unrolled: every group's inverse level-major in one list (twice the
    # independent products per level; see `inverse.invert_unit_lower`).
    pres = [prepare(gi) for gi in range(st.hv // st.interleave)]
    t_all = invert([a for pre in pres for a in pre["a_list"]])
    for gi, pre in enumerate(pres):
      finish(gi, pre, t_all[gi * st.interleave:(gi + 1) * st.interleave])
  else:
    def group(gi, carry):
      pre = prepare(gi)
      finish(gi, pre, invert(pre["a_list"]))
      return carry

    common.run_groups(st, group)
  if write_out:
    # Consecutive items of one block (`requests`: a request's last, the next
    # one's first) share the resident output block: each merges its own rows.
    common.store_heads(out_scr, o_ref, rows)
