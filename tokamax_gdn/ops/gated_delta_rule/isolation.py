"""Packed sequences: a non-finite value stays in its segment, and in time.

`SegmentGuard` wraps the core of every backend (forward and backward): a
NaN / inf in one packed segment's inputs makes that segment's results NaN
from that token on and leaves the other segments, and the earlier tokens of
its own, exactly as with finite values (without `segment_ids` the row is one
segment: garbage in a right padding never reaches the real tokens).
`base.GatedDeltaRule` applies it (`guarded_autodiff` for cores differentiated
by autodiff); `base.GatedDeltaRuleVjp` applies it around an analytical
`_core_bwd`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import prologue


def _nonfinite_tokens(x: jax.Array, per_token_axes: int) -> jax.Array:
  """Whether any of the trailing `per_token_axes` axes holds a NaN or inf.

  As a float sum of x·0 (0 for finite x, NaN for NaN / inf; it cannot
  overflow): a boolean any() over the lanes costs TPU about ten times as
  much.
  """
  if not per_token_axes:
    return ~jnp.isfinite(x)
  zeros = jnp.sum(x * jnp.zeros((), x.dtype), axis=tuple(range(-per_token_axes, 0)),
                  dtype=jnp.float32)
  return jnp.isnan(zeros)


def _zero_where(bad: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.where(bad, jnp.zeros((), x.dtype), x)


def zero_nonfinite(x: jax.Array | None) -> jax.Array | None:
  """x with every NaN / inf replaced by 0 (None stays None)."""
  return None if x is None else _zero_where(~jnp.isfinite(x), x)


def _nan_where(bad: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.where(bad, jnp.full((), jnp.nan, x.dtype), x)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["seg", "first", "last", "bad", "bad_q", "bad_gate"],
    meta_fields=["group", "one_segment"])
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
    bad_q: [B, T, Hv] bool: the token's query is not finite; None for a
      forward that neither checks nor sanitises the queries: a query is read
      only by its own token's output (its row of Q Kᵀ and Q S), so a
      non-finite one already makes exactly that output NaN. The backward
      needs it (dK, dV sum over the queries of later tokens).
    bad_gate: [B, T, Hv] bool: the token's raw gate or its log-decay is not
      finite (any NaN / inf input counts, including g = -inf).
    group: Hv / Hk.
    one_segment: no `segment_ids` (every row is one segment): the running
      flags are then reductions over T and a compare, not cumulative sums
      over T (a cumsum along T costs TPU glue of the order of the kernel).
  """

  seg: jax.Array
  first: jax.Array
  last: jax.Array
  bad: jax.Array
  bad_q: jax.Array | None
  bad_gate: jax.Array
  group: int
  one_segment: bool = False

  def _take(self, x: jax.Array, pos: jax.Array) -> jax.Array:
    return jnp.take_along_axis(x, pos[..., None], axis=1)

  def _pos(self, bad: jax.Array) -> jax.Array:
    return jnp.arange(bad.shape[1], dtype=jnp.int32)[:, None]

  def running(self, bad: jax.Array) -> jax.Array:
    """[B, T, Hv]: a bad token at or before this one, in its segment."""
    if self.one_segment:
      pos = self._pos(bad)
      return pos >= jnp.min(jnp.where(bad, pos, bad.shape[1]), axis=1, keepdims=True)
    count = jnp.cumsum(bad, axis=1, dtype=jnp.int32)
    before_segment = self._take(count - bad, self.first)
    return count > before_segment

  def running_back(self, bad: jax.Array) -> jax.Array:
    """[B, T, Hv]: a bad token at or after this one, in its segment."""
    if self.one_segment:
      pos = self._pos(bad)
      return pos <= jnp.max(jnp.where(bad, pos, -1), axis=1, keepdims=True)
    count = jnp.cumsum(bad, axis=1, dtype=jnp.int32)
    return self._take(count, self.last) > count - bad

  def anywhere(self, bad: jax.Array) -> jax.Array:
    """[B, T, Hv]: a bad token anywhere in this token's segment."""
    if self.one_segment:
      return jnp.broadcast_to(jnp.any(bad, axis=1, keepdims=True), bad.shape)
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
    return is_first & segments.state_of_segment(per_state, self.seg)

  def at_segment_ends(self, per_state: jax.Array) -> jax.Array:
    """[B, N, Hv] segment flags -> [B, T, Hv] at the last token of those
    segments."""
    is_last = (self.last == jnp.arange(self.seg.shape[1]))[..., None]
    return is_last & segments.state_of_segment(per_state, self.seg)

  def sanitize_small(self, log_decay, beta, initial_state):
    """The per-token and state inputs sanitised (`sanitize`'s part for a core
    that sanitises q, k, v itself, `guards_in_core`)."""
    return (_zero_where(self.bad_gate, log_decay), zero_nonfinite(beta),
            zero_nonfinite(initial_state))

  def sanitize(self, q, k, v, log_decay, beta, initial_state):
    """The inputs with every non-finite value replaced by 0 (the queries kept
    as they are when `bad_q` is None)."""
    return (q if self.bad_q is None else zero_nonfinite(q), zero_nonfinite(k), zero_nonfinite(v),
            *self.sanitize_small(log_decay, beta, initial_state))

  def _output_flags(self) -> jax.Array:
    running = self.running(self.bad)
    return running if self.bad_q is None else running | self.bad_q

  def output_poison(self) -> jax.Array:
    """[B, T, Hv] float32: NaN at the tokens whose outputs are not finite,
    else 0 (for a core that poisons its outputs itself, `guards_in_core`)."""
    return jnp.where(self._output_flags(), jnp.float32(jnp.nan), jnp.float32(0))

  def poison_final_state(self, final_state):
    """NaN in the final states the bad inputs reach (None: none)."""
    if final_state is None:
      return None
    if final_state.ndim == 4:        # the state after the last token
      poisoned = self.running(self.bad)[:, -1]
    else:
      poisoned = self.per_segment(self.anywhere(self.bad), final_state.shape[1])
    return _nan_where(poisoned[..., None, None], final_state)

  def poison_outputs(self, out, final_state):
    """NaN in the outputs and final states the bad inputs reach."""
    out = _nan_where(self._output_flags()[..., None], out)
    return out, self.poison_final_state(final_state)

  def gradient_poison(self, d_out, d_final) -> jax.Array:
    """[B, T, Hv]: the tokens whose input gradients are not finite.

    From a segment's first bad input on (as its outputs), and at and before
    a non-finite cotangent of a finite output (or of a finite final state),
    which reaches every earlier token of its segment. A non-finite cotangent
    of an output the bad inputs already made NaN is what autodiff makes of
    that NaN downstream (0 * NaN, e.g. a loss that masks padding with
    `where`); it is taken as zero, so it does not flow backwards in time.
    """
    if self.bad_q is None:
      raise ValueError("gradient_poison needs a guard built with check_query=True.")
    forward = self.running(self.bad)
    bad_ct = _nonfinite_tokens(d_out, 1) & ~(forward | self.bad_q)
    if d_final is not None:
      bad_final = _nonfinite_tokens(d_final, 2)
      if bad_final.ndim == 2:        # the state after the row's last token
        bad_ct = bad_ct.at[:, -1].set(bad_ct[:, -1] | (bad_final & ~forward[:, -1]))
      else:                          # segment n's: at its last token
        bad_final = bad_final & ~self.per_segment(self.anywhere(self.bad), bad_final.shape[1])
        bad_ct = bad_ct | self.at_segment_ends(bad_final)
    return forward | self.bad_q | self.running_back(bad_ct)

  def poison_head_sums(self, poison, sums):
    """NaN in the [Hv] sums over the tokens (a_log's gradient) of the heads
    with a poisoned token, as a sum of the poisoned terms would be."""
    return _nan_where(jnp.any(poison, axis=(0, 1)), sums)

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
                   dt_bias, check_query: bool = True) -> SegmentGuard:
  """The `SegmentGuard` of the op's inputs: the raw query and key (before the
  prologue: its L2 norm is non-finite exactly where they are), v, beta,
  initial_state, segment_ids (None is one segment) and the raw gate inputs
  g, a_log, dt_bias; B, T >= 1. Without `check_query`, `bad_q` is None.

  The per-token flags are reductions of the raw inputs, apart from the
  prologue's: fused with the L2 norm, XLA's TPU reduction of the normalised
  q, k fell off a cliff, growing much faster than T.
  """
  b, t, hk, _ = q.shape
  hv = v.shape[2]
  group = hv // hk
  per_value_head = lambda x: jnp.repeat(x, group, axis=2)
  if segment_ids is None:
    seg = first = jnp.zeros((b, t), jnp.int32)
    last = jnp.full((b, t), t - 1, jnp.int32)
  else:
    starts = segments.segment_starts(segment_ids)
    pos = jnp.arange(t, dtype=jnp.int32)
    seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    first = segments.segment_first(starts)
    last = jax.lax.cummin(jnp.where(segments.segment_ends(starts), pos, t - 1), axis=1,
                          reverse=True)
  # Before the log-decay floor, which would turn -inf into -30.
  bad_gate = ~jnp.isfinite(g) | ~jnp.isfinite(prologue.gate_log_decay(g, a_log, dt_bias))
  bad = (per_value_head(_nonfinite_tokens(k, 1)) | _nonfinite_tokens(v, 1)
         | bad_gate | ~jnp.isfinite(beta))
  bad_q = per_value_head(_nonfinite_tokens(q, 1)) if check_query else None
  guard = SegmentGuard(seg, first, last, bad, bad_q, bad_gate, group,
                       one_segment=segment_ids is None)
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
    grads = core_vjp((zero_nonfinite(d_out), zero_nonfinite(d_final)))
    return (*guard.poison_gradients(poison, *grads), None)

  run.defvjp(run_fwd, run_bwd)
  return run(q, k, v, log_decay, beta, initial_state, guard)
