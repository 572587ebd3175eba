"""Context-parallel gated delta rule: T sharded over a mesh axis inside `jax.shard_map`.

Per value head the recurrence is affine in the state, token by token:

  S_t = M_t S_{t-1} + beta_t k_t v_t^T,   M_t = (I - beta_t k_t k_t^T) exp(g_t)   (K x K)

so device d's tokens map the state entering it, S_in, to

  S_out = A S_in + B,   A = M_T ... M_1,  B = the local run's final state from zero.

Two passes over the local tokens, each made of calls of THE OP ITSELF
(whichever implementation), around one exchange:
  - the fold: a call with zero values [B, T, Hv, K] and initial state I_K
    gives A (its final state); the plain call from a zero state gives B (its
    final state). A segment starting inside the device resets the state, so A
    is 0 from there on: the chain is cut exactly as the unsharded op cuts it
    (and the composition selects B there rather than multiplying the
    entering state by that 0: a NaN before the cut stays before it).
  - one all_gather brings every device's (A, B) to every device, each device
    composes the P maps in sequence order (a scan of P small K x K @ K x V
    matmuls) and takes the state entering it: the caller's `initial_state`
    (or 0) for d = 0, and 0 when a segment starts exactly at device d's first
    token (found from the neighbours' segment ids, one more tiny all_gather);
  - the replay: the op from that state gives the outputs (and, per segment,
    the end states of the segments that end here).

Why all_gather + a local prefix rather than a ppermute chain: the chain needs
P dependent collective steps (each device waits for its predecessor's state),
the gather one collective whose payload, P·(K·K + K·V) floats per head (16 MiB
at P=4, 32 heads, K=V=128), is small next to the local work; the P-step
prefix is a few hundred small matmuls, and computing it on every device also
gives every device the final state: `final_state` is replicated over the axis.

Why a replay rather than a readout: the outputs are affine in S_in too,
o_t = o_t(0) + S_in^T r_t with r_t = scale (M_t ... M_1)^T q_t (the transition
call's outputs), which saves the replay's forward. But r and its cotangent
are [T_local, Hv, K] each, kept from the forward to the backward: 1.27x the
unsharded op's temp memory (tpu7x, Qwen3-Next heads, 2048 tokens per
device), where the replay keeps what the unsharded op keeps.

Memory. Nothing keeps a per-chunk stack of A: the backward is autodiff
through the above, each op call's analytical VJP inside (the gather's
transpose hands each device the cotangent of its own (A, B)). Left to itself
XLA would run the op backwards side by side, each with its recomputed chunk
states (1 KiB per token and head at K=V=128, C=64), and would hold every
call's gradients until it sums them. So the fold's calls run in up to four
key-head groups, keep only their arguments, run their forwards again inside
their backward steps (as `jax.checkpoint`) and run their backwards one at a
time (`context_parallel.one_backward_at_a_time`), each adding its gradients
to one running sum, after the replay's backward (which needs their results).
What stays beyond the unsharded op's own is that sum (one set of input
gradients, during the fold's backward) and O(P·Hv·K·(K+V)) for the
gathered maps. Measured numbers: docs/sharding.md, "Long context". The price in
compute: per device, the op's forward three times in the forward pass
(transition, zero-state call, replay), and in the backward pass the fold's
two forwards again plus three backwards, against one forward and one
backward of the unsharded op on T/P tokens.

Requirements: T divisible by the axis size (shard_map's even split; the
local T need not be a multiple of any chunk size).
"""

import functools

import jax
import jax.numpy as jnp

from tokamax_gdn import registry
from tokamax_gdn.ops import checks
from tokamax_gdn.ops import context_parallel as cp
from tokamax_gdn.ops import segments

_HIGHEST = jax.lax.Precision.HIGHEST


def _compose(a_all, b_all, resets, cuts, entry):
  """States entering each device [P, B, Hv, K, V] and the state after the last one.

  a_all [P, B, Hv, K, K], b_all [P, B, Hv, K, V]: every device's map
  S -> A S + B, in sequence order. resets [P, B] (or [P, 1]): a segment starts
  at device j's first token (always at j = 0); the state entering it is then
  entry(j) [B, Hv, K, V] instead of the previous device's output. cuts [P, B]
  (or [P, 1]): a segment starts inside device j, so A = 0 there and its output
  is B alone.

  Both are selects, never products with a zero A: an entering state that is
  NaN or inf (a poisoned segment before the cut) would give 0 * NaN = NaN in
  the next segment, forwards, and in the backward the gradient of that zero A
  (cotangent x entering state) would be NaN too; the entering state is zeroed
  where it is cut off, so neither direction multiplies it.
  """

  def step(s, xs):
    j, a, b, reset, cut = xs
    s_in = jnp.where(reset[:, None, None, None], entry(j), s)
    cut = cut[:, None, None, None]
    carried = jnp.einsum("bhij,bhjv->bhiv", a, jnp.where(cut, 0.0, s_in),
                         precision=_HIGHEST)
    return jnp.where(cut, b, carried + b), s_in

  size = a_all.shape[0]
  final, entering = jax.lax.scan(
      step, jnp.zeros(b_all.shape[1:], jnp.float32),
      (jnp.arange(size), a_all, b_all, resets, cuts))
  return entering, final


def gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    *,
    axis_name: str,
    scale: float | None,
    initial_state: jax.Array | None,
    output_final_state: bool,
    use_qk_l2norm: bool,
    use_beta_sigmoid: bool,
    a_log: jax.Array | None,
    dt_bias: jax.Array | None,
    segment_ids: jax.Array | None,
    implementation,
) -> tuple[jax.Array, jax.Array | None]:
  """`api.gated_delta_rule` on this device's slice of T (see module doc).

  Returns the local outputs and, with `output_final_state`, the final state
  of the whole sequence (or every segment's, for per-segment states), the
  same on every device of the axis.
  """
  index, size = cp.axis_position(axis_name)
  b, t, hk, dk = query.shape
  hv, dv = value.shape[2], value.shape[3]
  per_segment = initial_state is not None and initial_state.ndim == 5
  if per_segment:
    if segment_ids is None:
      raise ValueError("Per-segment states ([B, N, Hv, K, V] `initial_state`) need"
                       " `segment_ids`.")
    n_states = initial_state.shape[1]
    checks.require_shape("initial_state", initial_state, (b, n_states, hv, dk, dv),
                         "[B, N, Hv, K, V] per-segment states")
  elif initial_state is not None:
    checks.require_shape("initial_state", initial_state, (b, hv, dk, dv), "[B, Hv, K, V]")
  bounds = cp.boundaries(segment_ids, axis_name, size)
  first_segment, last_run = bounds.first_segment[index], bounds.last_run[index]   # [B]

  def call(v, s0, q, k, g, beta, a_log, dt_bias, segment_ids, final=True):
    return registry.call(
        "gated_delta_rule", implementation, q, k, v, g, beta,
        scale=scale, initial_state=s0, output_final_state=final,
        use_qk_l2norm=use_qk_l2norm, use_beta_sigmoid=use_beta_sigmoid, a_log=a_log,
        dt_bias=dt_bias, segment_ids=segment_ids)

  def final_only(*args):
    return call(*args)[1]

  # The fold, in `groups` key-head groups (whole GVA groups): per group the
  # transition call (zero values from I_K: A) and the zero-state call (B).
  # Every fold call keeps only its arguments and is recomputed inside its own
  # backward step, one backward at a time, each adding its gradient to one
  # running sum: its zero values, head slices, outputs, gradients and the
  # transients of its backward (the recomputed chunk states above all) then
  # live only there, at 1/groups of the replay's size.
  groups = next(d for d in (4, 2, 1) if hk % d == 0)
  rk, rv = hk // groups, hv // groups

  def group(i, x):
    """Group i's value heads (x: [B, T or N, Hv, ...] arrays, [Hv] parameters)."""
    if x is None:
      return None
    heads = slice(i * rv, (i + 1) * rv)
    return x[heads] if x.ndim == 1 else x[:, :, heads]

  def fold_call(i, v, s0, args):
    q, k, g, beta, a_log, dt_bias, segment_ids = args
    kh = slice(i * rk, (i + 1) * rk)
    return final_only(v, s0, q[:, :, kh], k[:, :, kh], group(i, g), group(i, beta),
                      group(i, a_log), group(i, dt_bias), segment_ids)

  def transition(i, args, _):
    eye = jnp.eye(dk, dtype=jnp.float32)
    # Per-segment mode: one state slot, so that the result is the first local
    # segment's transition even when another segment follows it.
    eye = jnp.broadcast_to(eye, (b, 1, rv, dk, dk) if per_segment else (b, rv, dk, dk))
    return fold_call(i, jnp.zeros((b, t, rv, dk), value.dtype), eye, args[1:])

  def from_zero(i, args, s0):
    """The state after the last local run, the first run started from zero
    (per segment: every local run's end state, later runs from `s0`)."""
    return fold_call(i, group(i, args[0]), s0, args[1:])

  shared = (value, query, key, g, beta, a_log, dt_bias, segment_ids)
  calls = [(functools.partial(transition, i), None) for i in range(groups)]
  calls += [(functools.partial(from_zero, i), None) for i in range(groups)]
  if per_segment:
    # The segments starting on this device (local run j >= 1) start from their
    # own states; the first local run's state is the incoming one (slot 0).
    local = first_segment[:, None] + jnp.arange(n_states)
    local_states = segments.state_of_segment(initial_state, local)
    local_states = local_states.astype(jnp.float32)
    # Every local run's end state with the first one started from zero: the
    # last run's, when it is one of the N, is this device's B.
    zero_first = local_states.at[:, 0].set(0.0)
    calls += [(functools.partial(from_zero, i), group(i, zero_first)) for i in range(groups)]
  maps = cp.one_backward_at_a_time(shared, *calls)
  heads = lambda parts: jnp.concatenate(parts, axis=-3)
  a_map, b_map = heads(maps[:groups]), heads(maps[groups:2 * groups])
  if per_segment:
    chain_map, run_ends = b_map, heads(maps[2 * groups:])
    first_run_map = a_map[:, 0]          # the first local run's transition
    a_map = jnp.where((last_run == 0)[:, None, None, None], first_run_map, 0.0)
    # The last local run's end state: from the per-segment call when that run
    # is one of its N (then from its own state), else (a run past N, started
    # from zero) from the chain call.
    last_end = run_ends[jnp.arange(b), jnp.minimum(last_run, n_states - 1)]
    b_map = jnp.where((last_run < n_states)[:, None, None, None], last_end, chain_map)
    entry = lambda j: segments.state_of_segment(initial_state.astype(jnp.float32),
                                                bounds.first_segment[j])
  else:
    s0 = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    entry = lambda j: jnp.where(j == 0, s0, 0.0)
  a_all, b_all = cp.gather((a_map, b_map), axis_name)
  entering, final = _compose(a_all, b_all, bounds.resets, bounds.last_run > 0, entry)
  s_in = entering[index]
  # The replay: the op on the local tokens from the state entering them.
  if per_segment:
    out, run_ends = call(value, local_states.at[:, 0].set(s_in), *shared[1:])
  else:
    out, _ = call(value, s_in, *shared[1:], final=False)
  if not output_final_state:
    return out, None
  if not per_segment:
    return out, final
  # Each segment's end state, from the device where it ends: local run j is
  # global segment first_segment + j; it ends here if a later run follows it
  # here, or at the last device, or before a reset on the next one.
  ends_here = jnp.where(index == size - 1, True,
                        bounds.resets[jnp.minimum(index + 1, size - 1)])
  run = jnp.arange(n_states)[None, :] - first_segment[:, None]            # [B, N]
  mine = (run >= 0) & (run < n_states) & ((run < last_run[:, None])
                                          | ((run == last_run[:, None]) & ends_here[:, None]))
  picked = run_ends[jnp.arange(b)[:, None], jnp.clip(run, 0, n_states - 1)]
  return out, jax.lax.psum(jnp.where(mine[..., None, None, None], picked, 0.0), axis_name)
