"""The backward Pallas GDN kernel: the chunks in reverse, carrying dS.

`bwd_kernel` recomputes Γ and the WY factors from the forward's residuals
(the state entering each chunk and T') and produces every gradient of the
chunk, d log-decay per token included (a reverse segmented cumsum in-kernel).
Algebra: `docs/gdn_math.md` ("Backward"); TPU design: `docs/gdn_pallas_tpu.md`.
"""

import functools
import math
import operator

from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from tokamax_gdn.ops import numerics
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_gates as gates
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_guard as guard
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kernel_prologue

F32, BF16 = jnp.float32, jnp.bfloat16


def bwd_kernel(*refs, names: tuple[str, ...], st: common.Static):
  r = common.Refs(names, refs)
  code_ref, q_ref, k_ref, v_ref, g_ref, b_ref = r.code, r.q, r.k, r.v, r.log_decay, r.beta
  st_ref, states_ref, tm_ref, do_ref, dht_ref = r.starts, r.states, r.tmats, r.d_out, r.d_final
  dq_ref, dk_ref, dv_ref, dg_ref, db_ref, dh0_ref = (
      r.dq, r.dk, r.dv, r.d_gate, r.dbeta, r.d_h0)
  ds_scr, rows_scr, qh_scr, kh_scr, vh_scr, doh_scr = r.ds, r.rows, r.qh, r.kh, r.vh, r.doh
  dgr_scr, dbr_scr = r.dg_rows, r.db_rows
  c, c_idx = st.chunk, pl.num_programs(1) - 1 - pl.program_id(1)
  # dq, dk, dv go into their (C, H D) output blocks head by head, in the
  # blocks' dtype: through f32 head-major scratch they took a store per f32
  # vreg more (and its load back), on the store slot v5e's backward is short
  # of (-2 % on its estimate), and 4 MiB of scoped VMEM at Qwen3-Next heads.
  dq_heads, dk_heads, dv_heads = (common.BlockHeads(ref, d, st, c_idx) for ref, d in
                            ((dq_ref, st.dim_k), (dk_ref, st.dim_k), (dv_ref, st.dim_v)))
  dim_k = st.dim_k
  dot = functools.partial(numerics.mxu, passes=st.passes, v5e_forms=st.v5e_forms)

  if st.n_states:     # the segment ends here: dS is its final state's cotangent
    code = code_ref[pl.program_id(0) * pl.num_programs(1) + c_idx]
    leave, enter = common.code_last(code) == 1, common.code_reset(code) == 1
  else:
    leave, enter = pl.program_id(1) == 0, pl.program_id(1) == pl.num_programs(1) - 1

  @pl.when(leave)
  def _init():
    if st.guard:
      guard.guard_enter(dht_ref, ds_scr, r.guard_carry, st)
    else:
      ds_scr[...] = dht_ref[...].astype(F32)

  gate, masks = kernel_prologue.step_prologue(g_ref, b_ref, st_ref, rows_scr, st, c_idx,
                               params=kernel_prologue.gate_params(r), scan_axis=1)
  causal, strict = masks
  # Without `st.bwd_copies` the call gives no head-major scratch (`head_scratch`).
  qh_scr, kh_scr, vh_scr, doh_scr = (
      common.head_tiles(ref, scr, d, st, c_idx)
      for ref, scr, d in ((q_ref, qh_scr, st.dim_k), (k_ref, kh_scr, st.dim_k),
                          (v_ref, vh_scr, st.dim_v), (do_ref, doh_scr, st.dim_v)))
  if st.guard:
    guard.guard_bwd_rows(r, st, gate, causal, leave, qh_scr, kh_scr, vh_scr, doh_scr)
  # The tiles as the head groups read them: sanitised by the guard in place
  # in scratch, or here by selects (`common.Static.bwd_copies`).
  clean = (lambda x: x) if st.bwd_copies else (lambda x: guard.guard_finite(x, st))
  lane = lax.broadcasted_iota(jnp.int32, (1, c), 1)
  # bf16 inputs under `st.f_cols`: the row sums of f ⊙ β (d_gcum's, below)
  # as columns, with β rounded to bf16, laid out as columns once: β's rows
  # against the one-hot (Hv, 128), transposed on the MXU (lane i: head i's β
  # column, exact).
  f_cols = st.passes == 1 and st.f_cols
  # decay_in's part of d_gcum as a float32 lane reduction (below), or on the MXU.
  lane_sums = st.v5e_forms and not f_cols and st.passes == 1
  carry_lane = lax.broadcasted_iota(jnp.int32, (c, 128), 1) if lane_sums else None
  if f_cols:
    b_rows = numerics.rounded_bf16(rows_scr[kernel_prologue.BETA], 1, st.v5e_forms)[0][0]
    b_cols = numerics.mm(b_rows, (lax.broadcasted_iota(jnp.int32, (st.hv, 128), 0)
                          == lax.broadcasted_iota(jnp.int32, (st.hv, 128), 1)).astype(BF16),
                 ta=True)

  def group(gi, carry):
    heads, kheads = common.group_heads(st, gi)
    kj = lambda u: u // st.group
    # The attention scale goes on the queries (the L2 norm's (C, 1) factor), not
    # on every value head's dO: the gradients are the same, dq's scale is
    # `kernel_prologue.normed_vjp`'s (one pass per key head, not per value head).
    q = {ku: common.finite(kernel_prologue.normed(clean(qh_scr[j]), st, st.scale)[0], st)
         for ku, j in kheads.items()}
    k = {ku: common.finite(kernel_prologue.normed(clean(kh_scr[j]), st)[0], st)
         for ku, j in kheads.items()}
    k_t = {ku: k[ku].T for ku in kheads}
    v = {u: common.finite(clean(vh_scr[i]), st) for u, i in heads.items()}
    d_o = {u: common.finite(clean(doh_scr[i]), st) for u, i in heads.items()}
    # The residuals as stored (bf16 for bf16 inputs): as matmul operands only,
    # not widened to f32 and cast back (S in f32 for ⟨S, dS⟩ is a load of its own).
    s = {u: states_ref[i] for u, i in heads.items()}
    tm = {u: tm_ref[i] for u, i in heads.items()}     # T'ᵀ where `common.tmat_transposed`
    tm_t = {u: common.tmat_transposed(st, u) for u in heads}
    dsn = {u: ds_scr[i] for u, i in heads.items()}
    beta = {u: common.head_row(rows_scr, kernel_prologue.BETA, i) for u, i in heads.items()}
    kout = {u: common.head_row(rows_scr, kernel_prologue.KOUT, i) for u, i in heads.items()}
    lam = {u: common.head_row(rows_scr, kernel_prologue.DECAY_CHUNK, i)[:, 0:1] for u, i in heads.items()}
    # Γ and decay_in from the compensated G for float32 inputs; for bfloat16
    # inputs from its float32 part alone: off by up to a few float32 ulps of
    # |G| (relative 6e-4 in Γ where |G| ~ 2000 at the −30 floor), below the
    # bfloat16 rounding of the inputs, for one transpose (XLU) and three vector
    # passes less per head.
    gammas, dins, dins_v = {}, {}, {}
    for u, i in heads.items():
      g_lo = common.head_row(rows_scr, kernel_prologue.G_LO, i) if st.passes > 1 else None
      gammas[u], dins[u], dins_v[u] = gates.gamma_decay_in(
          (common.head_row(rows_scr, kernel_prologue.G_HI, i), g_lo, gate.run), masks, dim_k, st.dim_v)
    qkk = {ku: dot(jnp.concatenate([q[ku], k[ku]], 0), k[ku], tb=True)
           for ku in kheads}
    if st.bwd_vnew:
      # Forward recompute in the forward kernels' form, V″ = T' (V − K_in S):
      # the gradients need no W̃ = T' K_in (below).
      k_in = {u: k[kj(u)] * dins[u] for u in heads}
      v_new = {u: dot(tm[u], v[u] - dot(k_in[u], s[u]), ta=tm_t[u]) for u in heads}
    else:
      # Forward recompute: [W̃ | Ũ] = T' [K_in | V], V″ = Ũ − W̃ S.
      wu = {u: dot(tm[u], common.operand_cat([k[kj(u)] * dins[u], v[u]], 1, st), ta=tm_t[u])
            for u in heads}
      v_new = {u: wu[u][:, dim_k:] - dot(wu[u][:, :dim_k], s[u]) for u in heads}
    ngb = {u: gammas[u] * -beta[u] for u in heads}                      # −Γ ⊙ β_j
    # State part: −dV″ = −P̃ᵀ dO − (K ⊙ kout_i) dS′ (the sign from β's and
    # kout's rows, so that dS = Q_inᵀ dO + W̃ᵀ (−dV″) + λ dS′ and [dO Sᵀ; dW̃]
    # take it as it is, and T'ᵀ (−dV″) = −dV).
    # The transposed products take their left operands as they are (ta):
    # cheaper than transposing them first on the XLU.
    # Every stacked operand by `common.operand_cat`, so that a tile stacked into
    # several (dO, dS, −dV″) is cast to bf16 once.
    nd_vnew = {}
    for u in heads:
      k_db = -kout[u] * k_t[kj(u)]                                     # −(K ⊙ (decay_out β)_i)ᵀ
      nd_vnew[u] = dot(common.operand_cat([qkk[kj(u)][:c] * ngb[u], k_db], 0, st),   # −P̃ ⊙ β_j
                       common.operand_cat([d_o[u], dsn[u]], 0, st), ta=True)
    # decay_in on dO's rows (Q_inᵀ dO = Qᵀ (decay_in ⊙ dO)), which then
    # reaches dq's part, dO_in Sᵀ, too: one C×K pass per head less than on Q
    # and on dO Sᵀ.
    d_oin = {u: d_o[u] * dins_v[u] for u in heads}
    if st.bwd_vnew:
      # WY part through V″ = T' (V − K_in S) (docs/gdn_math.md, "Backward"):
      # dV = T'ᵀ dV″, dK_in = −dV Sᵀ, dS gets −K_inᵀ dV (= W̃ᵀ (−dV″)), and
      # −dA' = [dK_in | dV] [W̃ | Ũ]ᵀ = dV (Ũ − W̃ S)ᵀ = dV V″ᵀ. n_dv = −dV.
      n_dv = {u: dot(tm[u], nd_vnew[u], ta=not tm_t[u]) for u in heads}
      wy = {u: (k_in[u], n_dv[u]) for u in heads}
    else:
      wy = {u: (wu[u][:, :dim_k], nd_vnew[u]) for u in heads}
    for u, i in heads.items():
      lhs = common.operand_cat([q[kj(u)], wy[u][0]], 0, st)
      ds_scr[i] = lam[u] * dsn[u] + dot(lhs, common.operand_cat([d_oin[u], wy[u][1]], 0, st),
                                        ta=True)
    if st.bwd_vnew:
      dq_s = {u: dot(d_oin[u], s[u], tb=True) for u in heads}          # dO_in Sᵀ
      dk_s = {u: dot(n_dv[u], s[u], tb=True) for u in heads}           # dK_in
      d_v = {u: -n_dv[u] for u in heads}
    else:
      dqw = {u: dot(common.operand_cat([d_oin[u], nd_vnew[u]], 0, st), s[u], tb=True)
             for u in heads}                                            # [dO_in Sᵀ; dW̃]
    dpk = {u: dot(common.operand_cat([d_o[u], dsn[u]], 0, st), v_new[u], tb=True)
           for u in heads}                                              # [dP̃; d(Kᵀ kout)]
    if not st.bwd_vnew:
      # WY part: [dK_in | dV] = T'ᵀ [dW̃ | dŨ];  dA' = −[dK_in | dV] [W̃ | Ũ]ᵀ.
      d_xin = {u: dot(tm[u], common.operand_cat([dqw[u][c:], -nd_vnew[u]], 1, st),
                      ta=not tm_t[u]) for u in heads}
      dq_s = {u: dqw[u][:c] for u in heads}
      dk_s = {u: d_xin[u][:, :dim_k] for u in heads}
      d_v = {u: d_xin[u][:, dim_k:] for u in heads}
    # Through V″ dA' = n_dv V″ᵀ (its sign folded into the terms that use it:
    # 4 % fewer cycles on v5e's estimate than negating it here), else −dA'.
    d_a = {u: jnp.where(strict, dot(n_dv[u], v_new[u], tb=True) if st.bwd_vnew
                        else dot(d_xin[u], wu[u], tb=True), 0.0)
           for u in heads}
    # Sums per key head, started by their first term (no adds of zeros).
    # d_QK, d_KK and d(K_out) are summed over a key head's value heads
    # before the products with Q and K and the transpose: one per key head.
    dq_acc, dk_acc, dqk_sum, dkb_sum = {}, {}, {}, {}
    acc = lambda sums, ku, x: x if ku not in sums else sums[ku] + x
    f_pieces = 1 if st.passes == 1 else 2     # f's bf16 pieces (below)
    for u, i in heads.items():
      ku = kj(u)
      d_p, d_kb = dpk[u][:c], dpk[u][c:]
      dv_heads[i] = d_v[u]
      d_kk = (-d_a[u] if st.bwd_vnew else d_a[u]) * ngb[u]            # dA' ⊙ β_j Γ
      nd_qk = numerics.lhs_masked(causal, d_p * ngb[u], st.v5e_forms)           # −d_QK
      dqk_sum[ku] = acc(dqk_sum, ku, jnp.concatenate([nd_qk, d_kk], 0))
      dkb_sum[ku] = acc(dkb_sum, ku, d_kb * kout[u])
      # dΓ ⊙ Γ = f ⊙ β_j with f = dA' ⊙ M + dP̃ ⊙ P̃ = Γ ⊙ (dP̃ ⊙ QKᵀ + dA' ⊙ KKᵀ);
      # dβ_j gets colsum(f).
      # f is rounded to the bf16 pieces its row sums take on the MXU, and
      # its column sums are taken of that (see d_gcum's row below).
      f_qk = d_p * qkk[ku][:c]
      f_bf16, f = numerics.rounded_bf16(
          gammas[u] * (f_qk + d_a[u] * qkk[ku][c:] if st.bwd_vnew
                       else f_qk - d_a[u] * qkk[ku][c:]), f_pieces, st.v5e_forms)
      f_col = jnp.sum(f, axis=0, keepdims=True)
      dk_in = dk_s[u] * dins[u]
      dq_acc[ku] = acc(dq_acc, ku, dq_s[u])
      dk_acc[ku] = acc(dk_acc, ku, dk_in)
      # Per-token parts of dβ and d_gcum (docs/gdn_math.md), as rows.
      d_kout = jnp.sum(d_kb * k_t[ku], axis=0, keepdims=True)          # d(decay_out β)_j
      decay_out = common.head_row(rows_scr, kernel_prologue.DECAY_OUT, i)
      d_dout = d_kout * kout[u]                                          # d decay_out · decay_out
      d_lam = jnp.sum(dsn[u] * states_ref[i].astype(F32)) * lam[u]
      dbr_scr[pl.ds(i, 1), :] = f_col + d_kout * decay_out
      dgr_scr[pl.ds(i, 1), :] = (
          # rowsum(e) − colsum(e) cancels in every suffix sum of d_gcum (all of
          # e's pairs inside it): the row sums must be exact sums of the
          # terms the column sums add, else a truncation (~2⁻¹⁶ of e for hi +
          # lo) is left in every token's dg, large next to a strongly
          # decaying head's tiny true dg. So f is rounded to its pieces
          # first: each product with β's pieces is exact, and the rounding
          # (2⁻⁹ of f for bf16 inputs, 2⁻¹⁶ for float32) moves both sums
          # alike. bf16 inputs: one piece; under `st.f_cols` with β
          # rounded to bf16 on both sides, the row sums as columns in the
          # carried tile (below), else against β's three pieces as a row;
          # float32: two pieces against β's three, as a row. Of the forms
          # tried (three pieces or one as a row, stacked with decay_in's part,
          # β's column selected in bf16, f ⊙ β rounded as one tile) columns
          # were the cheapest on v6e's estimate, the row with one piece on
          # v5e's and tpu7x's (`common.f_sums_as_columns`).
          (-numerics.rounded_bf16(beta[u], 1, st.v5e_forms)[1] * f_col if f_cols else
           gates.rowsum_row(f, pieces=f_pieces, weights=beta[u], v5e_forms=st.v5e_forms)
           - beta[u] * f_col)
          - d_dout
          + jnp.where(lane == c - 1, jnp.sum(d_dout) + d_lam, 0.0))
      # decay_in's part, into lane i of the carried columns: no cancellation
      # to keep. v5e, bf16 inputs: a lane reduction in float32 (XLU), off the
      # MXU, whose streamed rows bound this kernel there (for float32 inputs
      # its temporaries took the Qwen3-Next backward 62 KiB past v5e's VMEM
      # limit); elsewhere on the MXU (`gates.lane_rowsums`, cheaper on v6e's
      # and tpu7x's estimates), one bf16 piece for bf16 inputs (a_log's and
      # dt_bias's gradients stay well within the bf16 tolerance), two for
      # float32.
      d_in = dk_in * k[ku] + dq_s[u] * q[ku]
      if lane_sums:
        carry = carry + jnp.where(carry_lane == i, jnp.sum(d_in, axis=1, keepdims=True), 0.0)
      else:
        carry = carry + gates.lane_rowsums(d_in, i, pieces=1 if st.passes == 1 else 2,
                                           v5e_forms=st.v5e_forms,
                                           weighted=(f_bf16[0], b_cols) if f_cols else None)
    for ku in kheads:
      if st.dk_sym:
        # d_KK is strictly lower triangular: d_KK + d_KKᵀ is exact, and its
        # product with K gives both of K Kᵀ's terms of dk, C rows through
        # the MXU fewer than d_KKᵀ K beside d_QKᵀ Q (`Static.dk_sym`).
        nd_qk, d_kk = dqk_sum[ku][:c], dqk_sum[ku][c:]
        both = dot(jnp.concatenate([nd_qk, d_kk + common.transposed_tile(d_kk, st)], 0), k[ku])
        back = -dot(nd_qk, q[ku], ta=True)                              # d_QKᵀ Q
      else:
        both = dot(dqk_sum[ku], k[ku])                                 # [−d_QK K; d_KK K]
        back = dot(dqk_sum[ku], jnp.concatenate([-q[ku], k[ku]], 0), ta=True)
      dq_acc[ku] = dq_acc[ku] - both[:c]
      dk_acc[ku] = dk_acc[ku] + both[c:] + back + dkb_sum[ku].T
    for ku, j in kheads.items():
      # The VJP at the sanitised q, k (they differ at non-finite rows only,
      # whose gradients come poisoned), the norms taken again: kept from the
      # start, they took tpu7x's backward past its scoped VMEM limit
      # at C=64, and v6e's estimate gained nothing.
      dq_heads[j] = kernel_prologue.normed_vjp(
          (q[ku], kernel_prologue.normed(clean(qh_scr[j]), st)[1]), dq_acc[ku], st.scale)
      dk_heads[j] = kernel_prologue.normed_vjp(
          (k[ku], kernel_prologue.normed(clean(kh_scr[j]), st)[1]), dk_acc[ku])
    return carry

  in_cols = common.run_groups(st, group, jnp.zeros((c, 128), F32))
  d_gcum = dgr_scr[...] + in_cols.T[:st.hv]
  # d_gcum's reverse cumsum in the segment, d_g_j = Σ_{i ≥ j, same segment}
  # d_gcum_i, as d_gcum @ causal on the MXU (three bf16 pieces: exact products,
  # float32 sums), where a compensated scan over lanes (`gates.chunk_cumsum`)
  # is a dependent chain.
  # (A product per piece: Hv rows need not be a multiple of bf16's 16.)
  mask = numerics.lhs_masked(causal, jnp.ones((c, c), F32), st.v5e_forms).astype(BF16)
  d_g = functools.reduce(operator.add, [
      numerics.mm(piece, mask) for piece in numerics.split_bf16(d_gcum, 3, st.v5e_forms)])
  if st.guard:      # NaN into every gradient of the poisoned tokens
    guard.guard_bwd_tiles(r, st, dq_heads, dk_heads, dv_heads)
    poison = guard.nan_where(r.guard_rows[0])
    d_g = d_g + poison
    dbr_scr[...] = dbr_scr[...] + poison
  d_gate, d_a_log = kernel_prologue.log_decay_vjp(g_ref, kernel_prologue.gate_params(r), st, d_g.T)
  dg_ref[...] = d_gate.astype(dg_ref.dtype)
  if d_a_log is not None:
    # a_log's and dt_bias's gradients, summed over the row's chunks in the
    # resident output block (per-token terms took tpu7x past its VMEM; per
    # chunk parts and dg in float32 for XLA to sum cost two fusions and a
    # convert; one stacked [B, 2, Hv] output cost a slicing fusion). A select, not
    # a branch, starts the sums (the block holds garbage at the first chunk):
    # the two branches cost fewer cycles but more scoped VMEM,
    # which took the backward of Qwen3-Next's heads split over tpu7x's two
    # devices at T=4096 past its 21 MiB.
    for ref, x in ((r.d_a_log, d_a_log), (r.d_dt_bias, d_gate)):
      before = jnp.where(pl.program_id(1) == 0, 0.0, ref[...])
      ref[...] = before + jnp.sum(common.tail_mask(x, st, c_idx), axis=0, keepdims=True)
  d_beta = dbr_scr[...]
  if st.beta_sigmoid:     # the sigmoid's VJP: beta (1 - beta) from the chunk's rows
    beta = rows_scr[kernel_prologue.BETA]
    d_beta = d_beta * (beta * (1.0 - beta))
  db_ref[...] = d_beta.T.astype(db_ref.dtype)

  if dh0_ref is None:    # no initial state: no gradient of it
    return

  @pl.when(enter)
  def _final():
    if st.guard:    # a segment's initial state counts as its first token's input
      guard.guard_state_out(dh0_ref, ds_scr, r.guard_rows.at[0])
    else:
      dh0_ref[...] = ds_scr[...]
