"""Gated delta rule: the Op every implementation derives from.

Recurrence (per batch b and value head h, reading key head h // (Hv // Hk)):

  S_t = exp(g_t) * S_{t-1}
  S_t = S_t + beta_t * k_t (v_t - k_t^T S_t)^T          S_t: [K, V], float32
  o_t = scale * S_t^T q_t

with q, k L2-normalised first (x / sqrt(sum x^2 + 1e-6)) when `use_qk_l2norm`,
and g_t = -exp(a_log) * softplus(g_raw + dt_bias) when `a_log`/`dt_bias` are
given. `segment_ids` resets S to zero where the id changes (t > 0); the first
segment starts from `initial_state`.

Per-segment states: with `segment_ids`, `initial_state` may be [B, N, Hv, K, V]:
segment n of row b (the n-th run of equal ids, counted from 0) starts from
initial_state[b, n], and the final state is [B, N, Hv, K, V], segment n's own
end state (zeros where a row has fewer than N segments). Segments past the
N-th start from zero and their end states are not returned. Chunked backends
run this on a re-layout where every segment starts at a chunk boundary
(`align_segments`; math.md, "Per-segment states").

Split of work:
- `GatedDeltaRule.bind` validates and canonicalises once, for all backends.
- `prologue` (l2norm + gate activation) is pointwise per token; it is shared and
  differentiated by autodiff in `GatedDeltaRuleVjp`.
- Backends implement `_core_fwd` (and, for an analytical backward, a
  `GatedDeltaRuleVjp` subclass implementing `_core_bwd`) on the prepared
  q, k (input dtype, normalised), v, log-decay (float32) and beta.
- `SegmentGuard` wraps the core (forward and backward) for every backend: a
  NaN / inf in one packed segment's inputs makes that segment's results NaN
  from that token on and leaves the other segments, and the earlier tokens of
  its own, exactly as with finite values (without `segment_ids` the row is
  one segment: a garbage-filled right padding never reaches the real tokens).
- B = 0 or T = 0 never reach the core (empty results, the state passes through).

The chunked algorithm both chunked backends implement is in `math.md`.
"""

import dataclasses
import functools
from typing import Any, ClassVar, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member
from tokamax._src.ops import op

from tokamax_gdn.autotuning import ShippedAutotuningCacheMixin
from tokamax_gdn.ops import autodiff
from tokamax_gdn.ops import checks

AbstractArray = jax.ShapeDtypeStruct | jax.core.ShapedArray
Output: TypeAlias = tuple[jax.Array, jax.Array | None]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["states", "tmats"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Residuals:
  """What a forward hands its analytical backward besides the op inputs.

  states: states saved at N points of the sequence (chunk or block entries;
    which ones, and their layout, is the implementation's business), or None.
  tmats: per-chunk WY inverses, for implementations that save them, or None.
  """

  states: Float[Array, "..."] | None = None
  tmats: Float[Array, "..."] | None = None

L2NORM_EPS = 1e-6

# Chunked implementations add log-decays into an in-chunk cumsum G and take
# exp(G_i - G_j). A very negative gate (a "forget": -1e4 from a large raw gate)
# makes |G| large, and float32 cancellation in G_i - G_j then loses the small
# decays after it. Flooring the log-decay at -30 bounds |G| and changes the
# result by at most exp(-30) ~ 1e-13 relative (the state is multiplied by
# ~0 either way); the floored tokens get a zero gate gradient (true: < 1e-13).
CHUNKED_LOG_DECAY_FLOOR = -30.0


def l2norm(x: jax.Array) -> jax.Array:
  """x / sqrt(sum(x^2) + 1e-6) over the last axis, computed in float32."""
  x32 = x.astype(jnp.float32)
  return x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + L2NORM_EPS)


def gate_log_decay(
    g: jax.Array, a_log: jax.Array | None, dt_bias: jax.Array | None
) -> jax.Array:
  """Log-decay in float32: g itself, or -exp(a_log) * softplus(g + dt_bias)."""
  g = g.astype(jnp.float32)
  if a_log is None:
    return g
  if dt_bias is not None:
    g = g + dt_bias.astype(jnp.float32)
  return -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(g)


def prologue(
    query: jax.Array,
    key: jax.Array,
    g: jax.Array,
    a_log: jax.Array | None,
    dt_bias: jax.Array | None,
    *,
    use_qk_l2norm: bool,
    log_decay_floor: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Per-token preparation shared by every backend: (q, k, log_decay).

  q and k keep the input dtype (normalised in float32 first); the log-decay is
  float32, floored at `log_decay_floor` when given.
  """
  if use_qk_l2norm:
    query = l2norm(query).astype(query.dtype)
    key = l2norm(key).astype(key.dtype)
  log_decay = gate_log_decay(g, a_log, dt_bias)
  if log_decay_floor is not None:
    log_decay = jnp.maximum(log_decay, log_decay_floor)
  return query, key, log_decay


def segment_starts(segment_ids: jax.Array | None, t: int) -> jax.Array | None:
  """[B, T] bool: True where a new segment starts (never at t = 0)."""
  if segment_ids is None:
    return None
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros_like(changed[:, :1]), changed], axis=1)


def segment_index(segment_ids: jax.Array) -> jax.Array:
  """[B, T] int32: n for the tokens of the n-th run of equal ids in the row."""
  starts = segment_starts(segment_ids, segment_ids.shape[1])
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def _check_segment_states(initial_state, segment_ids, per_state: tuple[int, ...]) -> None:
  """bind's checks of a per-segment `initial_state` [B, N, Hv, K, V]."""
  b, hv, dk, dv = per_state
  if segment_ids is None:
    raise ValueError(
        f"{checks.describe('initial_state', initial_state)}: a per-segment state"
        " [B, N, Hv, K, V] needs `segment_ids` (segment n starts from"
        " initial_state[:, n]); without them pass [B, Hv, K, V].")
  n = initial_state.shape[1]
  checks.require_shape("initial_state", initial_state, (b, n, hv, dk, dv),
                       "[B, N, Hv, K, V] per-segment states")
  if n < 1:
    raise ValueError(
        f"{checks.describe('initial_state', initial_state)}: N (states per row)"
        " must be at least 1.")


def empty_final_state(query, value, initial_state) -> jax.Array:
  """The final state when B or T is 0: the initial state passes through
  unchanged ([B, Hv, K, V]); per-segment states are zeros (no segments)."""
  b, _, hv, dv = value.shape
  if initial_state is None:
    return jnp.zeros((b, hv, query.shape[3], dv), jnp.float32)
  if initial_state.ndim == 5:
    return jnp.zeros(initial_state.shape, jnp.float32)
  return initial_state.astype(jnp.float32)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["position", "source", "segment", "chunk_segment", "chunk_reset",
                 "chunk_last", "num_segments"],
    meta_fields=["chunk_size", "num_states"])
@dataclasses.dataclass(frozen=True)
class SegmentLayout:
  """Packed segments re-laid so that each starts at a chunk boundary.

  Built by `align_segments` (see there and math.md, "Per-segment states").
  In the aligned layout of static length Ta = round_up(T + N (C - 1), C),
  segments 0..N (N = `num_states`) each start at a chunk boundary and are
  followed by pad tokens up to the next one; segments past N follow each other
  without padding (they start from zero and their end states are not
  returned, so an in-chunk start, handled by the chunked code's in-chunk
  segment masks, is enough). Pads carry q = k = v = 0, g = 0, beta = 0: the
  state passes through them unchanged.

  Attributes (B rows, T tokens, Ta aligned positions, Nc = Ta / C chunks):
    position: [B, T] int32, each token's aligned position (strictly increasing).
    source: [B, Ta] int32, the token at each aligned position; T for a pad.
    segment: [B, Ta] int32, the segment index of each aligned position (a pad
      belongs to the segment it follows).
    chunk_segment: [B, Nc] int32, the segment of each chunk's first position.
    chunk_reset: [B, Nc] bool, a segment starts at the chunk's first position:
      the state entering the chunk is initial_state[b, chunk_segment] (zeros
      from segment N on), selected rather than decayed.
    chunk_last: [B, Nc] bool, the chunk is the last of its segment: the state
      leaving it is that segment's final state (kept when chunk_segment < N).
    num_segments: [B] int32, segments per row.
    chunk_size: C.
    num_states: N.
  """

  position: jax.Array
  source: jax.Array
  segment: jax.Array
  chunk_segment: jax.Array
  chunk_reset: jax.Array
  chunk_last: jax.Array
  num_segments: jax.Array
  chunk_size: int
  num_states: int

  @property
  def aligned_length(self) -> int:
    return self.source.shape[1]

  def to_aligned(self, x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B, Ta, ...], zeros at the pads (differentiable)."""
    padded = jnp.concatenate([x, jnp.zeros_like(x[:, :1])], axis=1)
    return padded[jnp.arange(x.shape[0])[:, None], self.source]

  def from_aligned(self, x: jax.Array) -> jax.Array:
    """[B, Ta, ...] -> [B, T, ...], the tokens' positions (differentiable)."""
    return x[jnp.arange(x.shape[0])[:, None], self.position]

  def in_chunk_starts(self) -> jax.Array:
    """[B, Ta] bool: segment starts that are not at a chunk boundary (only
    segments past N can start there)."""
    changed = segment_starts(self.segment, self.aligned_length)
    at_boundary = (jnp.arange(self.aligned_length) % self.chunk_size) == 0
    return changed & ~at_boundary


def aligned_length(t: int, num_states: int, chunk_size: int) -> int:
  """Ta of `align_segments`: round_up(T + N (C - 1), C)."""
  return _round_up(t + num_states * (chunk_size - 1), chunk_size)


def align_segments(segment_ids: jax.Array, num_states: int, chunk_size: int) -> SegmentLayout:
  """The chunk-aligned layout of `segment_ids` [B, T] (T >= 1) for N states.

  Segment n < N is padded after its end to a multiple of C tokens, so that
  segments 1..N start at chunk boundaries (segment 0 starts at 0). Every
  token moves right by the padding of the segments before it; the total
  padding is at most N (C - 1), hence the static length
  Ta = round_up(T + N (C - 1), C).
  """
  b, t = segment_ids.shape
  c = chunk_size
  t_al = aligned_length(t, num_states, c)
  pos = jnp.arange(t, dtype=jnp.int32)
  starts = segment_starts(segment_ids, t)
  seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  seg_start = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  pad = jnp.where(ends & (seg < num_states), (seg_start - pos - 1) % c, 0)
  position = pos + jnp.cumsum(pad, axis=1, dtype=jnp.int32) - pad
  rows = jnp.arange(b)[:, None]
  source = jnp.full((b, t_al), t, jnp.int32).at[rows, position].set(
      jnp.broadcast_to(pos, (b, t)))
  segment = jnp.full((b, t_al), -1, jnp.int32).at[rows, position].set(seg)
  segment = jax.lax.cummax(segment, axis=1)        # pads join the segment they follow
  chunk_segment = segment[:, ::c]
  chunk_reset = jnp.concatenate(
      [jnp.ones((b, 1), bool), chunk_segment[:, 1:] != segment[:, c - 1:-1:c]], axis=1)
  chunk_last = jnp.concatenate([chunk_reset[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  return SegmentLayout(
      position=position, source=source, segment=segment,
      chunk_segment=chunk_segment, chunk_reset=chunk_reset, chunk_last=chunk_last,
      num_segments=seg[:, -1] + 1, chunk_size=c, num_states=num_states)


# ----------------------------------------------------------------------------
# Packed sequences: a non-finite value stays in its segment.
# ----------------------------------------------------------------------------


def _float64_to_float32(tree):
  """Every float64 array of `tree` as float32.

  All implementations compute in float32 and keep float32 states (one state
  layout for all of them, and the README's numerical contract is float32), so float64
  inputs (under jax_enable_x64) are cast on the way in, outside the op's
  custom VJP: their gradients come back as float64 through the cast, and
  `out` is cast back to float64.
  """
  def cast(x):
    if getattr(x, "dtype", None) == jnp.float64:
      return x.astype(jnp.float32)
    return x
  return jax.tree.map(cast, tree)


def _nonfinite_tokens(x: jax.Array, per_token_axes: int) -> jax.Array:
  """Whether any of the trailing `per_token_axes` axes holds a NaN or inf."""
  bad = ~jnp.isfinite(x)
  return jnp.any(bad, axis=tuple(range(-per_token_axes, 0))) if per_token_axes else bad


def _zero_where(bad: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.where(bad, jnp.zeros((), x.dtype), x)


def _nan_where(bad: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.where(bad, jnp.full((), jnp.nan, x.dtype), x)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["seg", "first", "last", "bad", "bad_q", "bad_gate"],
    meta_fields=["group"])
@dataclasses.dataclass(frozen=True)
class SegmentGuard:
  """Keeps a NaN / inf of one packed segment out of every other segment.

  Inside a chunk the matmuls mix the tokens of different segments with zero
  coefficients, and 0 * NaN = NaN, so masking is not enough: the non-finite
  inputs are replaced by zeros before the core runs (`sanitize`), which then
  computes every other segment exactly as with finite values, and NaN is put
  back afterwards where the true result is not finite: in the outputs from
  the first bad token of a segment on (plus a token's own output for a bad
  query), in the final state of a poisoned segment, and in the gradients of
  the tokens from the first bad input on and at and before a non-finite
  cotangent (`gradient_poison`): NaN never flows backwards in time.

  Built by `guard_segments`; all masks per token and value head [B, T, Hv]
  (key-side values are per key head and count for the value heads reading
  them).

  Attributes:
    seg: [B, T] int32 segment index n of each token.
    first, last: [B, T] int32 position of the first / last token of each
      token's segment.
    bad: [B, T, Hv] bool: the token's k, v, g or beta is not finite, or (at
      a segment's first token) the segment's initial state is not.
    bad_q: [B, T, Hv] bool: the token's query is not finite.
    bad_gate: [B, T, Hv] bool: the token's raw gate or its log-decay is not
      finite (any NaN / inf input counts, including g = -inf).
    group: Hv / Hk.
  """

  seg: jax.Array
  first: jax.Array
  last: jax.Array
  bad: jax.Array
  bad_q: jax.Array
  bad_gate: jax.Array
  group: int

  def _take(self, x: jax.Array, pos: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, pos[..., None], axis=1)

  def running(self, bad: jax.Array) -> jax.Array:
    """[B, T, Hv]: a bad token at or before this one, in its segment."""
    count = jnp.cumsum(bad, axis=1, dtype=jnp.int32)
    before_segment = self._take(count - bad, self.first)
    return count > before_segment

  def running_back(self, bad: jax.Array) -> jax.Array:
    """[B, T, Hv]: a bad token at or after this one, in its segment."""
    count = jnp.cumsum(bad, axis=1, dtype=jnp.int32)
    return self._take(count, self.last) > count - bad

  def anywhere(self, bad: jax.Array) -> jax.Array:
    """[B, T, Hv]: a bad token anywhere in this token's segment."""
    count = jnp.cumsum(bad, axis=1, dtype=jnp.int32)
    return self._take(count, self.last) > self._take(count - bad, self.first)

  def per_segment(self, flags: jax.Array, n_states: int) -> jax.Array:
    """[B, T, Hv] segment-constant flags -> [B, N, Hv] (False past the row's
    segments)."""
    b, _, hv = flags.shape
    idx = jnp.minimum(self.seg, n_states)
    out = jnp.zeros((b, n_states + 1, hv), jnp.int32).at[
        jnp.arange(b)[:, None], idx].max(flags.astype(jnp.int32))
    return out[:, :n_states] > 0

  def at_segment_starts(self, per_state: jax.Array) -> jax.Array:
    """[B, Hv] (segment 0) or [B, N, Hv] (segment n) flags -> [B, T, Hv] at
    the first token of those segments."""
    is_first = (self.first == jnp.arange(self.seg.shape[1]))[..., None]
    if per_state.ndim == 2:
      return is_first & (self.seg == 0)[..., None] & per_state[:, None]
    n_states = per_state.shape[1]
    rows = jnp.arange(self.seg.shape[0])[:, None]
    flags = per_state[rows, jnp.minimum(self.seg, n_states - 1)]
    return is_first & (self.seg < n_states)[..., None] & flags

  def at_segment_ends(self, per_state: jax.Array) -> jax.Array:
    """[B, N, Hv] segment flags -> [B, T, Hv] at the last token of those
    segments."""
    is_last = (self.last == jnp.arange(self.seg.shape[1]))[..., None]
    n_states = per_state.shape[1]
    rows = jnp.arange(self.seg.shape[0])[:, None]
    flags = per_state[rows, jnp.minimum(self.seg, n_states - 1)]
    return is_last & (self.seg < n_states)[..., None] & flags

  def sanitize(self, q, k, v, log_decay, beta, initial_state):
    """The inputs with every non-finite value replaced by 0."""
    zero_bad = lambda x: _zero_where(~jnp.isfinite(x), x)
    state = None if initial_state is None else zero_bad(initial_state)
    return (zero_bad(q), zero_bad(k), zero_bad(v),
            _zero_where(self.bad_gate, log_decay), zero_bad(beta), state)

  def poison_outputs(self, out, final_state):
    """NaN in the outputs and final states the bad inputs reach."""
    running = self.running(self.bad)
    out = _nan_where((running | self.bad_q)[..., None], out)
    if final_state.ndim == 4:        # the state after the last token
      poisoned = running[:, -1]
    else:
      poisoned = self.per_segment(self.anywhere(self.bad), final_state.shape[1])
    return out, _nan_where(poisoned[..., None, None], final_state)

  def gradient_poison(self, d_out, d_final) -> jax.Array:
    """[B, T, Hv]: the tokens whose input gradients are not finite.

    From a segment's first bad input on (as its outputs), and at and before
    a non-finite cotangent of a finite output (or of a finite final state),
    which reaches every earlier token of its segment. A non-finite cotangent
    of an output the bad inputs already made NaN is what autodiff makes of
    that NaN downstream (0 * NaN, e.g. a loss that masks padding with
    `where`); it is taken as zero, so it does not flow backwards in time.
    """
    forward = self.running(self.bad)
    bad_out = forward | self.bad_q
    bad_ct = _nonfinite_tokens(d_out, 1) & ~bad_out
    if d_final is not None:
      bad_final = _nonfinite_tokens(d_final, 2)
      if bad_final.ndim == 2:        # the state after the row's last token
        bad_ct = bad_ct.at[:, -1].set(bad_ct[:, -1] | (bad_final & ~forward[:, -1]))
      else:                          # segment n's: at its last token
        bad_final = bad_final & ~self.per_segment(self.anywhere(self.bad), bad_final.shape[1])
        bad_ct = bad_ct | self.at_segment_ends(bad_final)
    return forward | self.bad_q | self.running_back(bad_ct)

  def poison_gradients(self, poison, dq, dk, dv, d_log_decay, dbeta, d_initial):
    """NaN in the gradients of the poisoned tokens' inputs."""
    b, t, hv = poison.shape
    key_poison = jnp.any(poison.reshape(b, t, hv // self.group, self.group), axis=-1)
    dq = _nan_where(key_poison[..., None], dq)
    dk = _nan_where(key_poison[..., None], dk)
    dv = _nan_where(poison[..., None], dv)
    d_log_decay = _nan_where(poison, d_log_decay)
    dbeta = _nan_where(poison, dbeta)
    if d_initial is not None:
      # A segment's initial state counts as its first token's input.
      if d_initial.ndim == 4:
        state_poison = poison[:, 0]
      else:
        is_first = (self.first == jnp.arange(self.seg.shape[1]))[..., None]
        state_poison = self.per_segment(poison & is_first, d_initial.shape[1])
      d_initial = _nan_where(state_poison[..., None, None], d_initial)
    return dq, dk, dv, d_log_decay, dbeta, d_initial


def guard_segments(q, k, v, beta, initial_state, segment_ids, *, g, a_log,
                   dt_bias) -> SegmentGuard:
  """The `SegmentGuard` of the prologue's q, k (and v, beta, initial_state,
  segment_ids: None is one segment) and the raw gate inputs g, a_log,
  dt_bias; B, T >= 1."""
  b, t, hk, _ = q.shape
  hv = v.shape[2]
  group = hv // hk
  per_value_head = lambda x: jnp.repeat(x, group, axis=2)
  starts = (jnp.zeros((b, t), bool) if segment_ids is None
            else segment_starts(segment_ids, t))
  pos = jnp.arange(t, dtype=jnp.int32)
  seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  first = jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)
  ends = jnp.concatenate([starts[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  last = jax.lax.cummin(jnp.where(ends, pos, t - 1), axis=1, reverse=True)
  # Before the log-decay floor, which would turn -inf into -30.
  bad_gate = ~jnp.isfinite(g) | ~jnp.isfinite(gate_log_decay(g, a_log, dt_bias))
  bad = (per_value_head(_nonfinite_tokens(k, 1)) | _nonfinite_tokens(v, 1)
         | bad_gate | ~jnp.isfinite(beta))
  guard = SegmentGuard(seg, first, last, bad, per_value_head(_nonfinite_tokens(q, 1)),
                       bad_gate, group)
  if initial_state is not None:
    bad = bad | guard.at_segment_starts(_nonfinite_tokens(initial_state, 2))
  return dataclasses.replace(guard, bad=bad)


def guarded_autodiff(core, guard: SegmentGuard, q, k, v, log_decay, beta, initial_state):
  """(out, final_state) of `core` under `guard`, for cores differentiated by
  autodiff: a custom VJP sanitises the cotangents and puts NaN into the
  gradients of poisoned segments (`GatedDeltaRuleVjp` does the same around
  an analytical `_core_bwd`)."""

  def clean_core(q, k, v, log_decay, beta, initial_state):
    return core(q, k, v, log_decay, beta, initial_state=initial_state)[:2]

  @jax.custom_vjp
  def run(q, k, v, log_decay, beta, initial_state, guard):
    out, final = clean_core(*guard.sanitize(q, k, v, log_decay, beta, initial_state))
    return guard.poison_outputs(out, final)

  def run_fwd(q, k, v, log_decay, beta, initial_state, guard):
    clean = guard.sanitize(q, k, v, log_decay, beta, initial_state)
    (out, final), core_vjp = jax.vjp(clean_core, *clean)
    return guard.poison_outputs(out, final), (core_vjp, guard)

  def run_bwd(res, cts):
    core_vjp, guard = res
    d_out, d_final = cts
    poison = guard.gradient_poison(d_out, d_final)
    zero_bad = lambda x: _zero_where(~jnp.isfinite(x), x)
    grads = core_vjp((zero_bad(d_out), zero_bad(d_final)))
    return (*guard.poison_gradients(poison, *grads), None)

  run.defvjp(run_fwd, run_bwd)
  return run(q, k, v, log_decay, beta, initial_state, guard)


class GatedDeltaRule[C, K](ShippedAutotuningCacheMixin, op.Op[Any, Output, Residuals, C, K]):
  """Gated delta rule op. Subclasses implement `_core_fwd`."""

  # K or V above this: NotImplementedError, so `implementation=` falls through.
  max_head_dim: ClassVar[int | None] = None
  # Chunked backends set CHUNKED_LOG_DECAY_FLOOR (see there).
  log_decay_floor: ClassVar[float | None] = None
  # Whether `_core_fwd` (and the VJP's `_core_bwd`) take an initial_state of
  # shape [B, N, Hv, K, V] (per-segment states); if not, bind raises
  # NotImplementedError for one, so `implementation=` falls through.
  supports_segment_states: ClassVar[bool] = False

  def __call__(self, *args, **kwargs):
    """The op; float64 inputs run in float32 (see `_float64_to_float32`)."""
    with autodiff.reverse_mode_only("gated_delta_rule", args, kwargs):
      value = args[2] if len(args) > 2 else kwargs.get("value")
      args, kwargs = _float64_to_float32((args, kwargs))
      result = super().__call__(*args, **kwargs)
      if getattr(value, "dtype", None) == jnp.float64:
        (out, final_state), *residuals = result if kwargs.get("return_residuals") else (result,)
        out = (out.astype(jnp.float64), final_state)
        result = (out, *residuals) if residuals else out
      return result

  def bind(
      self,
      query: Float[Array | AbstractArray, "B T Hk K"],
      key: Float[Array | AbstractArray, "B T Hk K"],
      value: Float[Array | AbstractArray, "B T Hv V"],
      g: Float[Array | AbstractArray, "B T Hv"],
      beta: Float[Array | AbstractArray, "B T Hv"],
      *,
      scale: float | None = None,
      initial_state: Float[Array | AbstractArray, "B Hv K V"]
      | Float[Array | AbstractArray, "B N Hv K V"] | None = None,
      output_final_state: bool = False,
      use_qk_l2norm: bool = False,
      a_log: Float[Array | AbstractArray, "Hv"] | None = None,
      dt_bias: Float[Array | AbstractArray, "Hv"] | None = None,
      segment_ids: Int[Array | AbstractArray, "B T"] | None = None,
      return_residuals: bool = False,
  ) -> op.BoundArguments:
    """Checks shapes and dtypes once for every backend; fills in `scale`."""
    for name, x in (("query", query), ("key", key), ("value", value)):
      checks.require_rank(name, x, 4, "[batch, time, heads, head_dim]")
      checks.require_float(name, x)
    b, t, hk, dk = query.shape
    checks.require_shape("key", key, (b, t, hk, dk), "same as `query` [B, T, Hk, K]")
    if value.shape[:2] != (b, t):
      raise ValueError(
          f"{checks.describe('value', value)}: batch and time must match `query`"
          f" {(b, t)}."
      )
    hv, dv = value.shape[2], value.shape[3]
    if hk == 0 or hv % hk:
      raise ValueError(
          f"{checks.describe('value', value)}: value heads Hv={hv} must be a multiple"
          f" of key heads Hk={hk} (from `query`/`key`)."
      )
    for name, x in (("g", g), ("beta", beta)):
      checks.require_rank(name, x, 3, "[batch, time, value_heads]")
      checks.require_float(name, x)
      checks.require_shape(name, x, (b, t, hv), "[B, T, Hv]")
    if initial_state is not None:
      checks.require_float("initial_state", initial_state)
      if initial_state.ndim == 5:
        _check_segment_states(initial_state, segment_ids, (b, hv, dk, dv))
        if not self.supports_segment_states:
          raise NotImplementedError(
              f"{type(self).__name__} does not support per-segment states"
              " (`initial_state` of shape [B, N, Hv, K, V]).")
      else:
        checks.require_shape("initial_state", initial_state, (b, hv, dk, dv),
                             "[B, Hv, K, V], or [B, N, Hv, K, V] with `segment_ids`")
    if (a_log is None) != (dt_bias is None) and a_log is None:
      raise ValueError("`dt_bias` was given without `a_log`; pass both or neither.")
    for name, x in (("a_log", a_log), ("dt_bias", dt_bias)):
      if x is not None:
        checks.require_float(name, x)
        checks.require_shape(name, x, (hv,), "[Hv]")
    if segment_ids is not None:
      if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"{checks.describe('segment_ids', segment_ids)} must be integer.")
      checks.require_shape("segment_ids", segment_ids, (b, t), "[B, T]")
    if scale is None:
      scale = dk**-0.5
    if self.max_head_dim is not None and max(dk, dv) > self.max_head_dim:
      raise NotImplementedError(
          f"{type(self).__name__} supports head dims up to {self.max_head_dim};"
          f" got K={dk}, V={dv}."
      )
    return super().bind(
        query, key, value, g, beta,
        scale=float(scale),
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        use_qk_l2norm=bool(use_qk_l2norm),
        a_log=a_log,
        dt_bias=dt_bias,
        segment_ids=segment_ids,
        return_residuals=return_residuals,
    )

  def _fwd(
      self,
      query: Float[Array, "B T Hk K"],
      key: Float[Array, "B T Hk K"],
      value: Float[Array, "B T Hv V"],
      g: Float[Array, "B T Hv"],
      beta: Float[Array, "B T Hv"],
      *,
      scale: float,
      initial_state: Float[Array, "B Hv K V"] | None,
      output_final_state: bool,
      use_qk_l2norm: bool,
      a_log: Float[Array, "Hv"] | None,
      dt_bias: Float[Array, "Hv"] | None,
      segment_ids: Int[Array, "B T"] | None,
      return_residuals: bool,
      config: C,
  ) -> tuple[Output, Residuals]:
    q, k, log_decay = prologue(
        query, key, g, a_log, dt_bias, use_qk_l2norm=use_qk_l2norm,
        log_decay_floor=self.log_decay_floor,
    )
    core = functools.partial(self._core_fwd, scale=scale, segment_ids=segment_ids,
                             config=config)
    if query.shape[0] == 0 or query.shape[1] == 0:
      out = jnp.zeros(value.shape, value.dtype)
      final_state = empty_final_state(query, value, initial_state)
      residuals = None
    else:
      guard = guard_segments(q, k, value, beta, initial_state, segment_ids, g=g,
                             a_log=a_log, dt_bias=dt_bias)
      if self.vjp is None:       # differentiated by autodiff through this
        residuals = None
        out, final_state = guarded_autodiff(core, guard, q, k, value, log_decay, beta,
                                            initial_state)
      else:                      # `GatedDeltaRuleVjp` guards the backward
        *clean, clean_state = guard.sanitize(q, k, value, log_decay, beta, initial_state)
        out, final_state, residuals = core(*clean, initial_state=clean_state)
        out, final_state = guard.poison_outputs(out, final_state)
    out = out.astype(value.dtype)
    final_state = final_state if output_final_state else None
    return (out, final_state), (residuals if return_residuals else None)

  def _core_fwd(
      self,
      q: jax.Array,
      k: jax.Array,
      v: jax.Array,
      log_decay: jax.Array,
      beta: jax.Array,
      *,
      scale: float,
      initial_state: jax.Array | None,
      segment_ids: jax.Array | None,
      config: C,
  ) -> tuple[jax.Array, jax.Array, Residuals | None]:
    """Returns (out [B,T,Hv,V], final_state f32, residuals).

    final_state is [B, Hv, K, V], or [B, N, Hv, K, V] for per-segment states
    (`initial_state` [B, N, Hv, K, V], only if `supports_segment_states`).
    T and B are at least 1 here.
    """
    raise NotImplementedError


class GatedDeltaRuleVjp[C, K](ShippedAutotuningCacheMixin, op.Op[Any, dict[str, jax.Array], None, C, K]):
  """Analytical VJP plumbing: prologue by autodiff, `_core_bwd` by hand."""

  # Must equal the forward Op's `log_decay_floor`.
  log_decay_floor: ClassVar[float | None] = None

  def _get_autotuning_cache_key(self, ba: op.BoundArguments) -> Any:
    """tokamax's key with `residuals` as None.

    The residuals' shapes follow the forward's config (how many states it
    saved), which autotuning the forward changes; the fastest backward tiling
    depends on the shapes of the inputs. Without this, tuning the forward
    would orphan every tuned VJP entry. A backward whose config doesn't fit the
    saved residuals recomputes what it needs.
    """
    key = super()._get_autotuning_cache_key(ba)
    return type(key)({**key, "residuals": None})

  def _fwd(
      self,
      residuals: Residuals | None,
      out: Output,
      dout: Output,
      query: Float[Array, "B T Hk K"],
      key: Float[Array, "B T Hk K"],
      value: Float[Array, "B T Hv V"],
      g: Float[Array, "B T Hv"],
      beta: Float[Array, "B T Hv"],
      *,
      scale: float,
      initial_state: Float[Array, "B Hv K V"] | None,
      output_final_state: bool,
      use_qk_l2norm: bool,
      a_log: Float[Array, "Hv"] | None,
      dt_bias: Float[Array, "Hv"] | None,
      segment_ids: Int[Array, "B T"] | None,
      return_residuals: bool,
      config: C,
  ) -> tuple[dict[str, jax.Array], None]:
    del out, return_residuals
    pro = functools.partial(prologue, use_qk_l2norm=use_qk_l2norm,
                            log_decay_floor=self.log_decay_floor)
    (q, k, log_decay), pro_vjp = jax.vjp(pro, query, key, g, a_log, dt_bias)
    d_out, d_final = dout
    if not output_final_state or d_final is None:
      d_final = None
    if query.shape[0] == 0 or query.shape[1] == 0:
      dq, dk, dv, d_log_decay, dbeta = map(jnp.zeros_like, (q, k, value, log_decay, beta))
      d_initial = None
      if initial_state is not None:
        # T = 0: a [B, Hv, K, V] state passes through; per-segment states
        # reach no output (there are no segments).
        d_initial = (d_final if d_final is not None and initial_state.ndim == 4
                     else jnp.zeros_like(initial_state, jnp.float32))
    else:
      core_bwd = functools.partial(self._core_bwd, residuals, scale=scale,
                                   segment_ids=segment_ids, config=config)
      guard = guard_segments(q, k, value, beta, initial_state, segment_ids, g=g,
                             a_log=a_log, dt_bias=dt_bias)
      poison = guard.gradient_poison(d_out, d_final)
      *clean, clean_state = guard.sanitize(q, k, value, log_decay, beta, initial_state)
      zero_bad = lambda x: None if x is None else _zero_where(~jnp.isfinite(x), x)
      grads = core_bwd(*clean, zero_bad(d_out), zero_bad(d_final),
                       initial_state=clean_state)
      dq, dk, dv, d_log_decay, dbeta, d_initial = guard.poison_gradients(poison, *grads)
    dquery, dkey, dg, da_log, ddt_bias = pro_vjp(
        (dq.astype(q.dtype), dk.astype(k.dtype), d_log_decay.astype(jnp.float32))
    )
    grads = dict(
        query=dquery,
        key=dkey,
        value=dv.astype(value.dtype),
        g=dg.astype(g.dtype),
        beta=dbeta.astype(beta.dtype),
    )
    if initial_state is not None:
      grads["initial_state"] = d_initial.astype(initial_state.dtype)
    if a_log is not None:
      grads["a_log"] = da_log
      if dt_bias is not None:
        grads["dt_bias"] = ddt_bias
    return grads, None

  def _core_bwd(
      self,
      residuals: Residuals | None,
      q: jax.Array,
      k: jax.Array,
      v: jax.Array,
      log_decay: jax.Array,
      beta: jax.Array,
      d_out: jax.Array,
      d_final: jax.Array | None,
      *,
      scale: float,
      initial_state: jax.Array | None,
      segment_ids: jax.Array | None,
      config: C,
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns (dq, dk, dv, d_log_decay, dbeta, d_initial_state f32).

    d_initial_state has initial_state's shape ([B, Hv, K, V] or, for
    per-segment states, [B, N, Hv, K, V]); None without an initial state.
    """
    raise NotImplementedError

