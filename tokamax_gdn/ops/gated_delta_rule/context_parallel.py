"""Context-parallel gated delta rule: T sharded over a mesh axis inside `jax.shard_map`.

Per value head the recurrence is affine in the state, token by token:

  S_t = M_t S_{t-1} + beta_t k_t v_t^T,   M_t = (I - beta_t k_t k_t^T) exp(g_t)   (K x K)

so device d's tokens map the state entering it, S_in, to

  S_out = A S_in + B,   A = M_T ... M_1,  B = the local run's final state from zero,

and every local output is affine in S_in as well:

  o_t = scale S_t^T q_t = o_t(0) + S_in^T r_t,   r_t = scale (M_t ... M_1)^T q_t.

All of these come from THE OP ITSELF (whichever implementation), twice per
device on the local tokens:
  - the plain call from a zero state gives o(0) and B;
  - a call with zero values [B, T, Hv, K] and initial state I_K gives r (its
    outputs: scale S_t^T q_t with S_t = M_t...M_1) and A (its final state).
    A segment starting inside the device resets that state, so A and r are 0
    from there on: the chain is cut exactly as the unsharded op cuts it.
Then one all_gather brings every device's (A, B) to every device, each device
composes the P maps in sequence order (a scan of P small K x K @ K x V
matmuls), takes the state entering it and adds S_in^T r_t to its outputs. The
state entering device d is the caller's `initial_state` (or 0) for d = 0, and
0 when a segment starts exactly at device d's first token (found from the
neighbours' segment ids, one more tiny all_gather).

Why all_gather + a local prefix rather than a ppermute chain: the chain needs
P dependent collective steps (each device waits for its predecessor's state),
the gather one collective whose payload, P·(K·K + K·V) floats per head (16 MiB
at P=4, 32 heads, K=V=128), is small next to the local work; the P-step
prefix is a few hundred small matmuls, and computing it on every device also
gives every device the final state: `final_state` is replicated over the axis.

Why no replay of the local tokens from S_in (the other common design): the
outputs are affine in S_in, so r_t carries all a replay would, and the two op
calls have the local op's widths (V, and K for the transition) rather than
one of width K+V plus a replay. Nothing keeps a per-chunk stack of A: the
backward is autodiff through the above, each op call's analytical VJP inside
(the gather's transpose hands each device the cotangent of its own (A, B)).

Memory. Left to itself XLA would run the two op backwards side by side, each
with its recomputed chunk states (1 KiB per token and head at K=V=128, C=64):
1.9x the temp memory of the unsharded op on the same local T. So the op
backwards run one at a time (`context_parallel.one_backward_at_a_time`): the
plain call's first, then the transition's, in two key-head groups when the
local key heads split evenly, each recomputed inside its own backward step
so that its zero values and head slices exist only there. What stays beyond
the plain op's own is r and its cotangent ([T_local, Hv, K] each, value
dtype) and O(P·Hv·K·(K+V)) for the gathered maps. Measured numbers: README,
"Long context". The price is one more forward pass of the transition call.

Requirements: T divisible by the axis size (shard_map's even split; the
local T need not be a multiple of any chunk size).
"""

import functools

import jax
import jax.numpy as jnp

from tokamax_gdn import registry
from tokamax_gdn.ops import checks
from tokamax_gdn.ops import context_parallel as cp

_HIGHEST = jax.lax.Precision.HIGHEST


def _compose(a_all, b_all, resets, entry):
  """States entering each device [P, B, Hv, K, V] and the state after the last one.

  a_all [P, B, Hv, K, K], b_all [P, B, Hv, K, V]: every device's map
  S -> A S + B, in sequence order. resets [P, B] (or [P, 1]): a segment starts
  at device j's first token (always at j = 0); the state entering it is then
  entry(j) [B, Hv, K, V] instead of the previous device's output.
  """

  def step(s, xs):
    j, a, b, reset = xs
    s_in = jnp.where(reset[:, None, None, None], entry(j), s)
    return jnp.einsum("bhij,bhjv->bhiv", a, s_in, precision=_HIGHEST) + b, s_in

  size = a_all.shape[0]
  final, entering = jax.lax.scan(
      step, jnp.zeros(b_all.shape[1:], jnp.float32),
      (jnp.arange(size), a_all, b_all, resets))
  return entering, final


def _states_at(states: jax.Array, segment: jax.Array) -> jax.Array:
  """states [B, N, Hv, K, V] at segment [B] (zeros from N on: those start from zero)."""
  n = states.shape[1]
  picked = states[jnp.arange(states.shape[0]), jnp.clip(segment, 0, n - 1)]
  return jnp.where((segment < n)[:, None, None, None], picked, 0.0)


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

  def call(v, s0, q, k, g, beta, a_log, dt_bias, segment_ids):
    return registry.call(
        "gated_delta_rule", implementation, q, k, v, g, beta,
        scale=scale, initial_state=s0, output_final_state=True,
        use_qk_l2norm=use_qk_l2norm, a_log=a_log, dt_bias=dt_bias,
        segment_ids=segment_ids)

  # The transition call runs in `groups` key-head groups (whole GVA groups),
  # each recomputed inside its backward step, one backward at a time after
  # the plain call's: its zero values, head slices and the transients of its
  # backward (the recomputed chunk states above all) then live only there, at
  # 1/groups of the plain call's size, instead of adding a second full set.
  groups = 2 if hk % 2 == 0 else 1
  rk, rv = hk // groups, hv // groups

  def transition(i, q, k, g, beta, a_log, dt_bias, segment_ids):
    kh, vh = slice(i * rk, (i + 1) * rk), slice(i * rv, (i + 1) * rv)
    eye = jnp.eye(dk, dtype=jnp.float32)
    # Per-segment mode: one state slot, so that the result is the first local
    # segment's transition even when another segment follows it.
    eye = jnp.broadcast_to(eye, (b, 1, rv, dk, dk) if per_segment else (b, rv, dk, dk))
    return call(jnp.zeros((b, t, rv, dk), value.dtype), eye,
                q[:, :, kh], k[:, :, kh], g[:, :, vh], beta[:, :, vh],
                None if a_log is None else a_log[vh],
                None if dt_bias is None else dt_bias[vh], segment_ids)

  shared = (query, key, g, beta, a_log, dt_bias, segment_ids)
  calls = [(functools.partial(transition, i), shared, True) for i in range(groups)]
  if per_segment:
    # The segments starting on this device (local run j >= 1) start from their
    # own states; the first local run's comes through the readout.
    local = first_segment[:, None] + jnp.arange(n_states)
    local_states = jax.vmap(_states_at, in_axes=(None, 1), out_axes=1)(initial_state, local)
    local_states = local_states.at[:, 0].set(0.0)
    # The state after the last local run from zero, for the chain when that
    # run is past the per-segment call's N (which then returns no state for it).
    calls.append((lambda *a: call(*a)[1], (value, None, *shared), True))
    calls.append((call, (value, local_states, *shared), False))
    *parts, chain_map, (out_zero, run_ends) = cp.one_backward_at_a_time(*calls)
  else:
    calls.append((call, (value, None, *shared), False))
    *parts, (out_zero, b_map) = cp.one_backward_at_a_time(*calls)
  readout = jnp.concatenate([r for r, _ in parts], axis=2)
  a_map = jnp.concatenate([a for _, a in parts], axis=-3)     # heads

  if per_segment:
    first_run_map = a_map[:, 0]          # the first local run's transition
    a_map = jnp.where((last_run == 0)[:, None, None, None], first_run_map, 0.0)
    # The last local run's end state: from the per-segment call when that run
    # is one of its N (then from its own state), else (a run past N, started
    # from zero) from the chain call.
    last_end = run_ends[jnp.arange(b), jnp.minimum(last_run, n_states - 1)]
    b_map = jnp.where((last_run < n_states)[:, None, None, None], last_end, chain_map)
    entry = lambda j: _states_at(initial_state.astype(jnp.float32),
                                 bounds.first_segment[j])
  else:
    s0 = (jnp.zeros((b, hv, dk, dv), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    entry = lambda j: jnp.where(j == 0, s0, 0.0)
  a_all, b_all = cp.gather((a_map, b_map), axis_name)
  entering, final = _compose(a_all, b_all, bounds.resets, entry)
  s_in = entering[index]
  if readout.dtype == jnp.float32:
    carried = jnp.einsum("bthk,bhkv->bthv", readout, s_in, precision=_HIGHEST)
  else:
    # Below float32 the contract is 2e-2: S_in rounded to the value dtype and
    # the product kept in it (a float32 product would be a [T, Hv, V] float32
    # temporary, and its cotangent another).
    carried = jnp.einsum("bthk,bhkv->bthv", readout, s_in.astype(readout.dtype))
  out = (out_zero.astype(jnp.float32) + carried.astype(jnp.float32)).astype(value.dtype)
  if not output_final_state:
    return out, None
  if not per_segment:
    return out, final
  # Each segment's end state, from the device where it ends: local run j is
  # global segment first_segment + j; it ends here if a later run follows it
  # here, or at the last device, or before a reset on the next one.
  run_ends = run_ends.at[:, 0].add(
      jnp.einsum("bhij,bhjv->bhiv", first_run_map, s_in, precision=_HIGHEST))
  ends_here = jnp.where(index == size - 1, True,
                        bounds.resets[jnp.minimum(index + 1, size - 1)])
  run = jnp.arange(n_states)[None, :] - first_segment[:, None]            # [B, N]
  mine = (run >= 0) & (run < n_states) & ((run < last_run[:, None])
                                          | ((run == last_run[:, None]) & ends_here[:, None]))
  picked = run_ends[jnp.arange(b)[:, None], jnp.clip(run, 0, n_states - 1)]
  return out, jax.lax.psum(jnp.where(mine[..., None, None, None], picked, 0.0), axis_name)
