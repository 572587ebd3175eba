"""The NaN guard inside the Pallas GDN kernels (`common.Static.guard`).

`isolation.SegmentGuard`'s flags as rows (heads in sublanes, tokens in
lanes), per chunk: which tokens see a non-finite input in their segment, the
tiles sanitised, and the outputs, final state and gradients of those tokens
made NaN in VMEM, so a NaN in one packed segment never reaches another.
Semantics: `docs/gdn_math.md` ("Non-finite inputs").
"""

from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from tokamax_gdn.ops import numerics
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kernel_prologue
from tokamax_gdn.ops.gated_delta_rule import prologue

F32, BF16 = jnp.float32, jnp.bfloat16


def _bad_row(x, bf16=False):
  """(1, C) f32: 1 where row c of the tile x (C, D) holds a NaN or inf, else 0.

  The row sums of x·0 (0, or NaN for NaN / inf) by the MXU against ones (as
  `gates.rowsum_row`; NaN propagating as in the forward's poisoned P̃): a lane
  reduction on the vector units is several times dearer per vreg, and the
  XLA reductions of the raw k and v these rows replace were dearer still.

  `bf16`: x holds bf16 values or values within ±1 (a tile of a bf16 input,
  or its L2-normalised form), so its bf16 cast is finite where x is: x·0 is
  then taken in bf16, half the vregs (the forward kernels only: in the
  backward it cost more).
  """
  if bf16:
    zeros = x.astype(BF16) * jnp.zeros((), BF16)
  else:
    zeros = (x * 0.0).astype(BF16)
  sums = numerics.mm(jnp.ones((8, x.shape[1]), BF16), zeros, tb=True)[0:1]
  return (sums != sums).astype(F32)


def _bad_flag(x):
  """(1, 1) f32: 1 where the tile x (R, D) holds a NaN or inf (a state's)."""
  return jnp.max(_bad_row(x), axis=1, keepdims=True)


def guard_finite(x, st: "_Static"):
  """A head tile x (the forward's k or v, the backward's q, k, v or dO
  without `Static.bwd_copies`, as the head groups read it) with NaN / inf
  as 0 under `st.guard`: a select per tile in every chunk, where the head
  groups read it. (In place in scratch in a branch on the
  chunk's flags, `_guard_sanitize`, it needs the tiles copied to scratch,
  which cost v5e's forward kernels more than the selects, and the other
  generations' the branch itself: it splits the unrolled body into basic
  blocks the scheduler cannot overlap.)"""
  if not st.guard:
    return x
  return numerics.lhs_masked(jnp.isfinite(x), x, st.v5e_forms)


def _guard_sanitize(flags, tiles, st: "_Static"):
  """Where the chunk has a bad token (`flags` (H, C) f32 > 0 anywhere): the
  head tiles in scratch (`tiles`: refs of (H, C, D)) with NaN / inf as 0, in
  place (the backward's q, k, v, dO). Finite chunks (every chunk of a finite
  run) skip it; as a branch it costs the backward far less than selects
  per tile where the head groups read them (`guard_finite`)."""
  @pl.when(jnp.max(flags) > 0.0)
  def _():
    for ref in tiles:
      def head(i, carry, ref=ref):
        x = ref[i]
        ref[i] = numerics.lhs_masked(jnp.isfinite(x), x, st.v5e_forms)
        return carry

      lax.fori_loop(0, ref.shape[0], head, 0)


def _poison_tile(nan_row, width: int, st: "_Static"):
  """(C, width) f32: row c NaN where the (1, C) row `nan_row` is NaN, else 0:
  diag(nan_row) @ ones on the MXU (a per-row select of a tile would be a
  lane broadcast), NaN propagating as in the forward's poisoned P̃."""
  c = nan_row.shape[-1]
  diag = (lax.broadcasted_iota(jnp.int32, (c, c), 0)
          == lax.broadcasted_iota(jnp.int32, (c, c), 1))
  return numerics.mm(numerics.lhs_masked(diag, nan_row, st.v5e_forms).astype(BF16), jnp.ones((c, width), BF16))


def poison_diag(x, nan_row, diag, st: "_Static"):
  """The C×C matmul operand x with NaN on its diagonal where the (1, C) row
  `nan_row` is NaN; in the operand's dtype (bf16 for bf16 inputs, but not
  on v5e): half the vregs of an f32 select."""
  if st.mm == BF16 and not st.v5e_forms:
    x, nan_row = x.astype(BF16), nan_row.astype(BF16)
  return jnp.where(diag, x + nan_row, x)


def nan_where(flags):
  return jnp.where(flags > 0.0, jnp.float32(jnp.nan), 0.0)


def _guard_gate_rows(r: "_Refs", st: "_Static", c_idx):
  """(Hv, C) f32: 1 where the token's raw gate, its log-decay (before the
  floor) or its beta is not finite (`isolation.guard_segments`' `bad_gate`
  and beta; `kernel_prologue._log_decay` and `kernel_prologue.step_prologue` read them as 0); tail rows 0."""
  g = r.log_decay[...].astype(F32)
  bad = ~jnp.isfinite(g) | ~jnp.isfinite(kernel_prologue.beta_block(r.beta, st))
  if st.gate_act:
    bad = bad | ~jnp.isfinite(prologue.gate_log_decay(g, *kernel_prologue.gate_params(r)))
  return common.tail_mask(bad.astype(F32), st, c_idx).T


def _guard_heads(st: "_Static", per_key_head):
  """Runs per_key_head(j, [value heads of key head j]) for every key head."""
  for j in range(st.hk):
    per_key_head(j, [j * st.group + u for u in range(st.group)])


def guard_enter(state_ref, s_scr, carry_ref, st: "_Static"):
  """On entering a row: the state `state_ref` (the initial state, or the
  backward's d_final) into `s_scr` with NaN / inf as 0, and per head whether
  it had any into `carry_ref` (zeros without `state_ref`)."""
  if state_ref is None:
    s_scr[...] = jnp.zeros(s_scr.shape, F32)
    carry_ref[...] = jnp.zeros(carry_ref.shape, F32)
    return

  for i in range(st.hv):
    x = state_ref[i].astype(F32)
    s_scr[i] = jnp.where(jnp.isfinite(x), x, 0.0)
    carry_ref[i:i + 1, :] = jnp.broadcast_to(_bad_flag(x), (1, carry_ref.shape[1]))


def guard_state_out(out_ref, s_scr, flags_ref):
  """out_ref = s_scr, NaN for the heads h whose flags (`flags_ref` (Hv, L))
  are set in lane 0 (a poisoned final state, or initial state's gradient): a
  copy, and where a head is poisoned (never in a finite run) a pass over the
  heads (a loop per head cost that on every row)."""
  out_ref[...] = s_scr[...]

  @pl.when(jnp.max(flags_ref[:, 0:1]) > 0.0)
  def _():
    def head(i, carry):
      out_ref[i] = out_ref[i] + nan_where(flags_ref[pl.ds(i, 1), 0:1])
      return carry

    lax.fori_loop(0, flags_ref.shape[0], head, 0)


def guard_fwd_rows(r: "_Refs", st: "_Static", gate: "ChunkGate", causal, c_idx,
                    write_out: bool, emit: bool, kh, vh):
  """The forward's flags of the chunk (`SegmentGuard.running`): a bad k, v,
  gate or beta at or before each token in its segment, or before the chunk
  (`guard_carry`, which this advances to the chunk's last token). Under
  `write_out` `guard_rows` gets the output poison (NaN at those tokens,
  else 0; the query is read as it is: a non-finite one reaches its own
  output only); under `emit` the flags go out for the backward
  (`guard_fwd`). `kh`, `vh`: the k and v head tiles as the head groups read
  them (scratch or `common.BlockHeads`; tail rows zeroed; normalised or raw,
  non-finite at the same rows), left as they are (the head groups read them
  sanitised, `guard_finite`)."""
  rows = r.guard_rows
  rows[...] = _guard_gate_rows(r, st, c_idx)

  v_bf16 = r.v.dtype == BF16 and not st.v5e_forms

  def key_head(j, heads):
    k_bad = _bad_row(kh[j], r.k.dtype == BF16 and not st.v5e_forms)
    for i in heads:
      rows[pl.ds(i, 1), :] = jnp.maximum(rows[pl.ds(i, 1), :],
                                         jnp.maximum(k_bad, _bad_row(vh[i], v_bf16)))

  _guard_heads(st, key_head)
  bad = rows[...]
  c = st.chunk
  mask = jnp.where(causal, 1.0, 0.0).astype(BF16)
  count = numerics.mm(bad.astype(BF16), mask, tb=True)          # Σ_{j <= i, same segment} bad_j
  carried = r.guard_carry[:, 0:1]
  if gate.run is not None:      # the segment going on from the last chunk
    carried = jnp.where(gate.run == 0.0, carried, 0.0)
  running = jnp.maximum(jnp.minimum(count, 1.0), carried)
  r.guard_carry[...] = jnp.broadcast_to(running[:, c - 1:c], r.guard_carry.shape)
  if emit:
    r.guard_fwd[...] = running
  if write_out:
    rows[...] = nan_where(running)


def guard_bwd_rows(r: "_Refs", st: "_Static", gate: "ChunkGate", causal, leave, qh, kh, vh, doh):
  """The backward's poison of the chunk (`SegmentGuard.gradient_poison`) into
  `guard_rows[0]`, 1 at the tokens whose gradients are NaN: the forward's
  flags (`guard_fwd`), a non-finite query, and a non-finite cotangent (dO,
  or at the row's last token d_final: `guard_carry` at `leave`) of a token
  not poisoned by those, at or after the token in its segment, or after the
  chunk (`guard_carry`, which this moves back to the chunk's first token).
  `qh`, `kh`, `vh`, `doh`: the head tiles as loaded (scratch, sanitised here
  in place, or `common.BlockHeads`, read through `guard_finite`:
  `common.Static.bwd_copies`)."""
  c, rows = st.chunk, r.guard_rows
  fwd = r.guard_fwd[...]

  def key_head(j, heads):
    q_bad = _bad_row(qh[j])
    for i in heads:
      before = jnp.maximum(r.guard_fwd[pl.ds(i, 1), :], q_bad)
      rows[0, pl.ds(i, 1), :] = before
      rows[1, pl.ds(i, 1), :] = _bad_row(doh[i]) * (1.0 - before)

  _guard_heads(st, key_head)
  if st.bwd_copies:
    _guard_sanitize(rows[0] + rows[1], (qh, kh, vh, doh), st)
  mask = jnp.where(causal, 1.0, 0.0).astype(BF16)
  count = numerics.mm(rows[1].astype(BF16), mask)                # Σ_{j >= i, same segment} bad_j
  last = (st.t_len - 1) % c
  carried = r.guard_carry[:, 0:1]
  carried = jnp.where(leave, carried * (1.0 - fwd[:, last:last + 1]), carried)
  if gate.run is not None:      # the segment going on into the next chunk
    carried = jnp.where(gate.run == gate.run[:, c - 1:c], carried, 0.0)
  back = jnp.maximum(jnp.minimum(count, 1.0), carried)
  first = back[:, 0:1]
  if gate.run is not None:      # a segment starting at the chunk's first token ends it
    first = jnp.where(gate.run[:, 0:1] == 0.0, first, 0.0)
  r.guard_carry[...] = jnp.broadcast_to(first, r.guard_carry.shape)
  rows[0] = jnp.maximum(rows[0], back)


def guard_bwd_tiles(r: "_Refs", st: "_Static", dq, dk, dv):
  """NaN into the chunk's dq, dk, dv head tiles (`common.BlockHeads` of their
  output blocks, written by the head groups already) at the poisoned
  tokens (`guard_rows[0]`): dv per value head, dq and dk where any value
  head of the key head's group is (`SegmentGuard.poison_gradients`), in a
  branch taken only in a chunk with a poisoned token, on every generation.
  (It sits after the head groups, not inside an unrolled body; with the
  leaner backward the branch beat adding the tiles in every chunk, on v6e
  and tpu7x.)"""
  rows = r.guard_rows

  def key_head(j, heads):
    key = rows[0, pl.ds(heads[0], 1), :]
    for i in heads:
      flags = rows[0, pl.ds(i, 1), :]
      key = jnp.maximum(key, flags)
      dv[i] = dv[i] + _poison_tile(nan_where(flags), st.dim_v, st)
    tile = _poison_tile(nan_where(key), st.dim_k, st)
    dq[j] = dq[j] + tile
    dk[j] = dk[j] + tile

  pl.when(jnp.max(rows[0]) > 0.0)(lambda: _guard_heads(st, key_head))
