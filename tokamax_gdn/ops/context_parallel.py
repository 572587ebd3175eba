"""What the context-parallel ops share: T sharded over a mesh axis inside `jax.shard_map`.

Device i of the axis (`jax.lax.axis_index`) holds tokens [i·T/P, (i+1)·T/P) of
every row, in order. The ops exchange only what crosses a device boundary:
the GDN composes per-device state maps (`gated_delta_rule/context_parallel.py`),
the conv passes the last W-1 inputs to the next device
(`causal_conv1d/context_parallel.py`). Segment boundaries that fall exactly
on a device boundary are invisible to the local ops (they see no id change at
their first token), so `boundaries` finds them from the neighbours' ids.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from tokamax_gdn.ops import segments


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


def one_backward_at_a_time(shared, *calls):
  """[fn(shared, extra) for fn, extra in calls], each call recomputed inside
  its own backward step and the backward steps run one at a time, last call
  first, accumulating the gradient of `shared` as they go.

  Autodiff leaves the backward passes of independent computations unordered,
  and XLA then runs them side by side, holding every set of transients at
  once (for the GDN op: the chunk states its VJP recomputes, 1 KiB per token
  and head), and holds every call's gradient of the arguments they share
  until it sums them. Here each call keeps only its arguments and runs its
  forward again inside its backward step (as `jax.checkpoint`), so what it
  builds from them (sliced or constant operands, the op's own residuals)
  lives only there; that step waits, through an optimization barrier, for the
  gradients of the call after it (for the last call: for its own cotangents,
  else XLA would hoist the recomputation into the forward's tail); and its
  gradient of `shared` is added to the running sum at once, so one set of
  them is alive, not one per call.

  `fn`s are Python callables; `shared` and the `extra` pytrees may hold
  integer arrays (they get no gradient) and None.
  """
  s_static, s_floats, s_others = _split(shared)
  static, e_floats, e_others = [], [], []
  for fn, extra in calls:
    st, fl, ot = _split(extra)
    static.append((fn, st))
    e_floats.append(fl)
    e_others.append(ot)
  return _ordered((s_static, tuple(static)), s_floats, s_others, e_floats, e_others)


def _split(tree):
  """(static (treedef, float mask), float leaves, other leaves) of a pytree."""
  leaves, treedef = jax.tree.flatten(tree)
  mask = tuple(bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact)) for x in leaves)
  return ((treedef, mask), [x for x, m in zip(leaves, mask) if m],
          [x for x, m in zip(leaves, mask) if not m])


def _join(static, floats, others):
  (treedef, mask), it_f, it_o = static, iter(floats), iter(others)
  return treedef.unflatten([next(it_f) if m else next(it_o) for m in mask])


def _vjp(static, i, s_floats, s_others, e_floats, e_others):
  """(call i's output, its VJP on (shared floats, its extra floats))."""
  s_static, calls = static
  fn, e_static = calls[i]
  return jax.vjp(lambda sf, ef: fn(_join(s_static, sf, s_others), _join(e_static, ef, e_others)),
                 s_floats, e_floats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ordered(static, s_floats, s_others, e_floats, e_others):
  return [_vjp(static, i, s_floats, s_others, e_floats[i], e_others[i])[0]
          for i in range(len(static[1]))]


def _ordered_fwd(static, s_floats, s_others, e_floats, e_others):
  outs = _ordered(static, s_floats, s_others, e_floats, e_others)
  return outs, (s_floats, s_others, e_floats, e_others)


def _ordered_bwd(static, residuals, cts):
  s_floats, s_others, e_floats, e_others = residuals
  count = len(static[1])
  e_grads, total = [None] * count, None
  gate = cts[-1]
  for i in reversed(range(count)):
    sf, ef, ct, gate = jax.lax.optimization_barrier((s_floats, e_floats[i], cts[i], gate))
    s_grads, e_grads[i] = _vjp(static, i, sf, s_others, ef, e_others[i])[1](ct)
    total = s_grads if total is None else jax.tree.map(jnp.add, total, s_grads)
    gate = (total, e_grads[i])
  # The integer leaves get no gradient.
  return (total, [None] * len(s_others), e_grads, [[None] * len(o) for o in e_others])


_ordered.defvjp(_ordered_fwd, _ordered_bwd)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["resets", "first_segment", "last_run"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Boundaries:
  """Where the segments of every row meet the devices of the axis, [P, B] each.

  resets: a segment starts at device j's first token (True for j = 0: the
    sequence's first segment starts there).
  first_segment: the global index (n-th run of ids in the row, from 0) of the
    segment running at device j's first token.
  last_run: the local index of the segment running at device j's last token
    (0 when one segment covers the whole device).
  """

  resets: jax.Array
  first_segment: jax.Array
  last_run: jax.Array


def boundaries(segment_ids: jax.Array | None, axis_name: str, size: int) -> Boundaries:
  """Every device's `Boundaries`, from one small all_gather of each device's
  first id, last id and local run count per row (no segment_ids: one segment)."""
  if segment_ids is None:
    b = 1
    gathered = jnp.zeros((size, b, 3), jnp.int32)
  else:
    runs = jnp.sum(segments.segment_starts(segment_ids), axis=1, dtype=jnp.int32)
    gathered = gather(jnp.stack([segment_ids[:, 0].astype(jnp.int32),
                                 segment_ids[:, -1].astype(jnp.int32), runs], axis=-1),
                      axis_name)
  first, last, last_run = gathered[..., 0], gathered[..., 1], gathered[..., 2]
  resets = jnp.concatenate([jnp.ones_like(first[:1], bool), first[1:] != last[:-1]], axis=0)
  # Device j's first segment: device j-1's first, plus its runs, plus one if
  # a new segment starts at the boundary.
  steps = jnp.concatenate([jnp.zeros_like(first[:1]), last_run[:-1] + resets[1:]], axis=0)
  return Boundaries(resets=resets, first_segment=jnp.cumsum(steps, axis=0, dtype=jnp.int32),
                    last_run=last_run)
