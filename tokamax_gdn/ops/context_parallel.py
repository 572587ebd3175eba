"""What the context-parallel ops share: T sharded over a mesh axis inside `jax.shard_map`.

Device i of the axis (`jax.lax.axis_index`) holds tokens [i·T/P, (i+1)·T/P) of
every row, in order. The ops exchange only what crosses a device boundary:
the GDN composes per-device state maps (`gated_delta_rule/context_parallel.py`),
the conv passes the last W-1 inputs to the next device
(`causal_conv1d/context_parallel.py`). Segment boundaries that fall exactly
on a device boundary are invisible to the local ops (they see no id change at
their first token), so `starts_at_device` finds them from the neighbours' ids.
"""

import jax
import jax.numpy as jnp


def axis_position(axis_name: str) -> tuple[jax.Array, int]:
  """(this device's index along `axis_name`, the axis size); a clear error when unbound."""
  try:
    size = jax.lax.axis_size(axis_name)
  except NameError as e:
    raise ValueError(
        f"context_parallel_axis={axis_name!r} is not a mesh axis bound here: call the op"
        " inside jax.shard_map over a mesh with that axis, with the sequence (T) axis of"
        " its inputs sharded over it.") from e
  return jax.lax.axis_index(axis_name), size


def gather(x, axis_name: str):
  """all_gather over the axis into a new leading axis, typed device-invariant.

  Every device then computes the same thing from the gathered values (the
  cross-device prefix), so results built only from them may be returned
  replicated over the axis; under `check_vma=True` the invariant type says so,
  and the transpose hands each device the cotangent of its own slice.
  """
  return jax.lax.all_gather(x, axis_name, to="invarying")


def shift_right(x, axis_name: str, size: int):
  """x of device i-1 on device i (zeros on device 0): one ppermute.

  Its transpose sends cotangents back to device i-1, so gradients of what a
  device reads from its predecessor reach the predecessor's inputs.
  """
  return jax.lax.ppermute(x, axis_name, [(i, i + 1) for i in range(size - 1)])


def starts_at_device(segment_ids: jax.Array | None, axis_name: str) -> jax.Array | None:
  """[P, B] bool: does a segment start at device j's first token? (False for j = 0).

  One small all_gather of every device's first and last id per row.
  """
  if segment_ids is None:
    return None
  ends = gather(jnp.stack([segment_ids[:, 0], segment_ids[:, -1]], axis=-1), axis_name)
  first, last = ends[..., 0], ends[..., 1]                       # [P, B]
  return jnp.concatenate(
      [jnp.zeros_like(first[:1], bool), first[1:] != last[:-1]], axis=0)
