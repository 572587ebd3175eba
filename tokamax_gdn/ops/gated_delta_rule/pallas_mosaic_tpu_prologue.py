"""The op's prologue inside the Pallas GDN kernels, and its VJPs.

The kernels read the raw q, k, gate and beta: `normed` L2-normalises a q or k
head tile, `log_decay` activates and floors the gate, `beta_block` takes
beta's sigmoid, `packed_heads` reads the heads of a packed serving block, and
`step_prologue` writes a chunk's gate rows (`G_HI`, ...) into row scratch.
`normed_vjp` and `log_decay_vjp` are the backward's halves. `Prologue` is the
host-side switch. Math: `prologue.py`, `docs/gdn_math.md`; design: `docs/gdn_pallas_tpu.md`.
"""

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jaxtyping import Array  # pylint: disable=g-importing-member

from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_gates as gates
from tokamax_gdn.ops.gated_delta_rule import prologue

F32, BF16 = jnp.float32, jnp.bfloat16


def packed_heads(x_ref, b_ref, qh_scr, kh_scr, vh_scr, st: common.Static, c_idx, rows=None):
  """The head tiles of a packed (C, 2 Hk K + Hv V) block into the head-major
  scratch: aligned lane slices of the block (no relayout; q and k are
  L2-normalised later, `normed`).

  `st.beta_guard`: v of value head u reads as 0 where beta_u is 0, k of a key
  head where beta is 0 on every value head of its group. Exact: a token's k
  and v reach the other tokens' outputs and the state only through its V''
  row, which is used scaled by its beta; a select makes NaN, inf or huge
  values there count as nothing (the serving op's tokens of other requests
  come with beta 0). A query reaches its own output only and is read as it is.
  `rows`: only rows [lo, hi) count (`common.row_mask`), the others as beta 0.
  """
  kd, vd, hk = st.dim_k, st.dim_v, st.hk
  live = None
  if st.beta_guard:
    beta = common.row_mask(common.tail_mask(beta_block(b_ref, st), st, c_idx), rows)   # (C, Hv)
    live = [beta[:, i:i + 1] != 0.0 for i in range(st.hv)]
  lanes = lambda start, width: common.lanes(x_ref, start, width, st, c_idx)
  for j in range(hk):
    q, k = lanes(j * kd, kd), lanes((hk + j) * kd, kd)
    if live is not None:
      heads = live[j * st.group:(j + 1) * st.group]
      k = jnp.where(functools.reduce(jnp.logical_or, heads), k, 0.0)
    qh_scr[j], kh_scr[j] = q, k
  for i in range(st.hv):
    v = lanes(2 * hk * kd + i * vd, vd)
    vh_scr[i] = v if live is None else jnp.where(live[i], v, 0.0)


def normed(x, st: common.Static, scale: float = 1.0):
  """A q or k head tile (C, K) f32 as the kernels use it, with the factor of
  its L2 norm: (x r, r), r = 1 / sqrt(sum(x²) + 1e-6) over each row (C, K)
  under `st.qk_l2norm` (`prologue.l2norm`, in float32 and not rounded to the
  input dtype), else (x, None). Per head tile: a whole block at once costs
  scoped VMEM. The sums are lane reductions: by
  the MXU against ones (three bf16 pieces, as `gates.rowsum_row`) they cost
  every kernel more on v6e's estimate. `scale`: the tile times scale (the factor r
  as it is)."""
  if not st.qk_l2norm:
    return (x, None) if scale == 1.0 else (x * scale, None)
  r = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + prologue.L2NORM_EPS)
  return x * (r if scale == 1.0 else r * scale), r


def normed_vjp(normed, dy, scale: float = 1.0):
  """The cotangent of the raw tile from dy, that of `normed = _normed(x,
  scale=scale)` = (scale y, r): scale r (dy - y <y, dy>) per row."""
  y, r = normed
  if r is None:
    return dy if scale == 1.0 else dy * scale
  if scale == 1.0:
    return r * (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True))
  # y here is scale times the normed tile: the scales go on the (C, 1) columns.
  dot_col = jnp.sum(y * dy, axis=-1, keepdims=True) * (1.0 / (scale * scale))
  return (r * scale) * (dy - y * dot_col)


def beta_block(b_ref, st: common.Static):
  """The chunk's betas (C, Hv) f32 from its beta block: with `st.beta_sigmoid`
  the sigmoid of its logits (±inf: 1 and 0; NaN stays NaN, a bad beta)."""
  beta = b_ref[...].astype(F32)
  if st.beta_sigmoid:
    beta = 1.0 / (1.0 + jnp.exp(-beta))
  return beta


def gate_params(r: "_Refs"):
  """(a_log, dt_bias) as (1, Hv) f32 rows under `st.gate_act`, else None."""
  return None if r.a_log is None else (r.a_log[...], r.dt_bias[...])


def _log_decay(g_ref, params, st: common.Static):
  """The chunk's log-decays (C, Hv) f32 from its gate block: the raw gate
  activated under `st.gate_act` (`prologue.gate_log_decay`, a_log and dt_bias
  the rows `params`: `gate_params`), then, with `st.log_decay_floor`, floored there,
  a non-finite one read as 0 (the guard's bad gates, whose outputs it
  poisons: `isolation.SegmentGuard.sanitize_small`)."""
  g = g_ref[...].astype(F32)
  if st.gate_act:
    g = prologue.gate_log_decay(g, *params)
  if st.log_decay_floor is not None:
    g = jnp.where(jnp.isfinite(g), jnp.maximum(g, st.log_decay_floor), 0.0)
  elif st.guard:
    g = jnp.where(jnp.isfinite(g), g, 0.0)
  return g


def log_decay_vjp(g_ref, params, st: common.Static, d_ld):
  """`_log_decay`'s VJP: from the log-decays' cotangent d_ld (C, Hv), the raw
  gate's and, under `st.gate_act`, the per-token terms of a_log's (d_ld times
  the log-decay; dt_bias's are the gate's), else None. Floored log-decays
  pass none (a tie half, as jnp.maximum's); non-finite ones are the guard's
  (their gradients come poisoned)."""
  g = g_ref[...].astype(F32)
  ld = g
  if st.gate_act:
    a_log, dt_bias = params
    ld = prologue.gate_log_decay(g, a_log, dt_bias)
  if st.log_decay_floor is not None:
    floor = st.log_decay_floor
    d_ld = d_ld * jnp.where(ld > floor, 1.0, jnp.where(ld == floor, 0.5, 0.0))
  if not st.gate_act:
    return d_ld, None
  sigmoid = 1.0 / (1.0 + jnp.exp(-(g + dt_bias)))
  return d_ld * (-jnp.exp(a_log) * sigmoid), d_ld * ld


# Rows of the per-step row scratch (each (Hv, C) f32).
G_HI, G_LO, BETA, KOUT, DECAY_CHUNK, DECAY_OUT = range(6)
N_ROWS = 6


def step_prologue(g_ref, b_ref, st_ref, rows_scr, st: common.Static, c_idx, rows=None,
                   params=None, scan_axis: int = 0):
  """Gates of the chunk for every head, into `rows_scr`; returns (gate, masks).

  masks: (causal, strict) C×C, with segments restricted to one segment.
  `rows`: see `common.row_mask`; `params`: see `_log_decay`; `scan_axis`: see
  `gates.chunk_gate`.
  """
  g_cols = common.row_mask(common.tail_mask(_log_decay(g_ref, params, st), st, c_idx), rows)
  b_rows = beta_block(b_ref, st)
  if st.guard:      # a non-finite beta as 0 (its tokens' results come poisoned)
    b_rows = jnp.where(jnp.isfinite(b_rows), b_rows, 0.0)
  b_rows = common.row_mask(common.tail_mask(b_rows, st, c_idx), rows).T
  starts = None
  if st.has_seg:
    starts = common.tail_mask(st_ref[...].astype(F32).T, st, c_idx)     # (C, 1)
  gate = gates.chunk_gate(g_cols, starts, scan_axis)
  rows_scr[G_HI] = gate.g_hi
  rows_scr[G_LO] = gate.g_lo
  rows_scr[BETA] = b_rows
  rows_scr[KOUT] = gate.decay_out * b_rows            # (decay_out β)_j
  rows_scr[DECAY_CHUNK] = jnp.broadcast_to(gate.decay_chunk, b_rows.shape)
  rows_scr[DECAY_OUT] = gate.decay_out
  return gate, (gate.causal, gate.strict)


@dataclasses.dataclass(frozen=True)
class Prologue:
  """The op's prologue (`prologue.prologue`), run in the kernels: with it
  they take the raw q, k and gate and L2-normalise / activate / floor them
  themselves (`common.Static.qk_l2norm`, `gate_act`, `log_decay_floor`). a_log and
  dt_bias: [Hv] arrays or None (dt_bias None with a_log: 0)."""

  qk_l2norm: bool = False
  a_log: jax.Array | None = None
  dt_bias: jax.Array | None = None
  log_decay_floor: float | None = None
  beta_sigmoid: bool = False

  def static(self) -> dict:
    return dict(qk_l2norm=self.qk_l2norm, gate_act=self.a_log is not None,
                log_decay_floor=self.log_decay_floor, beta_sigmoid=self.beta_sigmoid)

  def gate_params(self) -> tuple[jax.Array, jax.Array] | None:
    """(a_log, dt_bias) as [1, Hv] f32 (the kernels' inputs of those names;
    two inputs, not one stacked [2, Hv]: the stack was an XLA fusion of its
    own per call), or None."""
    if self.a_log is None:
      return None
    a_log = self.a_log.astype(F32).reshape(1, -1)
    dt = jnp.zeros_like(a_log) if self.dt_bias is None else self.dt_bias.astype(F32).reshape(1, -1)
    return a_log, dt
