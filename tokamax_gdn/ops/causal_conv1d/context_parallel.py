"""Context-parallel causal conv1d: T sharded over a mesh axis inside `jax.shard_map`.

Token t reads the W-1 inputs before it, so device d needs the last W-1 inputs
of device d-1 (its "halo"): one ppermute of [B, W-1, D]. The halo is the
local op's `initial_state`, which the op shows to the first local segment
only; device 0 gets the caller's `initial_state` (or zeros) instead. Halo rows
from an earlier segment than the one running at device d's first token are
zeroed, which is what the unsharded op does to them (a zero input adds 0 and
gets no gradient); so a segment starting exactly at the device boundary sees
no halo at all. The backward is autodiff: the ppermute's transpose returns the
halo's gradient to device d-1's inputs.

The final state (the last W-1 inputs, masked to the last segment) is the last
device's, summed over the axis from that device alone so that every device
returns it (replicated).

Requirements: T divisible by the axis size, and at least W-1 tokens per
device (the halo comes from the predecessor only).
"""

import jax
import jax.numpy as jnp

from tokamax_gdn import registry
from tokamax_gdn.ops import context_parallel as cp


def _visible_halo_rows(prev_ids: jax.Array, first_id: jax.Array) -> jax.Array:
  """[B, W-1] bool: halo rows in the same run of ids as this device's first token.

  A row is visible iff it and every row after it carry the first token's id
  (a segment is a contiguous run, so an equal id before a different one is a
  different segment).
  """
  same = (prev_ids == first_id[:, None]).astype(jnp.int32)
  return jnp.flip(jnp.cumprod(jnp.flip(same, axis=1), axis=1), axis=1).astype(bool)


def causal_conv1d(
    x: jax.Array,
    weight: jax.Array,
    bias: jax.Array | None,
    *,
    axis_name: str,
    activation: str | None,
    initial_state: jax.Array | None,
    output_final_state: bool,
    segment_ids: jax.Array | None,
    implementation,
) -> tuple[jax.Array, jax.Array | None]:
  """`api.causal_conv1d` on this device's slice of T (see module doc)."""
  index, size = cp.axis_position(axis_name)
  call = lambda s0: registry.call(
      "causal_conv1d", implementation, x, weight, bias,
      activation=activation, initial_state=s0,
      output_final_state=output_final_state, segment_ids=segment_ids)
  if x.ndim != 3 or weight.ndim != 2:
    return call(initial_state)            # the op's own shape errors
  b, t, d = x.shape
  halo = weight.shape[1] - 1
  if halo == 0:                           # W = 1: no token reads another
    return call(initial_state)
  if t < halo:
    raise ValueError(
        f"causal_conv1d with context_parallel_axis={axis_name!r}: each device needs at"
        f" least W-1={halo} tokens (it reads its halo from the previous device only);"
        f" got {t} per device.")
  prev = cp.shift_right(x[:, t - halo:], axis_name, size)
  if segment_ids is not None:
    prev_ids = cp.shift_right(segment_ids[:, t - halo:], axis_name, size)
    visible = _visible_halo_rows(prev_ids, segment_ids[:, 0])
    prev = jnp.where(visible[..., None], prev, jnp.zeros_like(prev))
  first = (jnp.zeros((b, halo, d), x.dtype) if initial_state is None else initial_state)
  y, final = call(jnp.where(index == 0, first, prev.astype(first.dtype)))
  if final is not None:
    final = jax.lax.psum(jnp.where(index == size - 1, final, jnp.zeros_like(final)),
                         axis_name)
  return y, final
