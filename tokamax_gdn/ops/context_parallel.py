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


def one_backward_at_a_time(*calls):
  """[fn(*args) for fn, args, recompute in calls], with the backward passes
  run one at a time, last call first.

  Autodiff leaves the backward passes of independent computations unordered,
  and XLA then runs them side by side, holding every set of transients at
  once (for the GDN op: the chunk states its VJP recomputes, 1 KiB per token
  and head). Here each call's VJP starts from its residuals passed through an
  optimization barrier together with the gradients of the call after it (for
  the last call: with its own cotangents), so nothing of it, not even what it
  recomputes from its residuals, can be scheduled earlier.

  A call with `recompute` keeps only its arguments and runs its forward again
  inside its backward step (as `jax.checkpoint`), so what it builds from them
  (sliced or constant operands, the op's own residuals) lives only there.
  `fn`s are Python callables; the args pytrees may hold integer arrays (they
  get no gradient) and None.
  """
  static, floats, others = [], [], []
  for fn, args, recompute in calls:
    leaves, tree = jax.tree.flatten(args)
    mask = tuple(bool(jnp.issubdtype(jnp.result_type(x), jnp.inexact)) for x in leaves)
    static.append((fn, tree, mask, bool(recompute)))
    floats.append([x for x, m in zip(leaves, mask) if m])
    others.append([x for x, m in zip(leaves, mask) if not m])
  return _ordered(tuple(static), floats, others)


def _vjp(static_one, floats, others):
  fn, tree, mask, _ = static_one

  def on_floats(floats):
    it_f, it_o = iter(floats), iter(others)
    return fn(*tree.unflatten([next(it_f) if m else next(it_o) for m in mask]))

  return jax.vjp(on_floats, floats)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ordered(static, floats, others):
  return [_vjp(*c)[0] for c in zip(static, floats, others)]


def _ordered_fwd(static, floats, others):
  outs, residuals = [], []
  for st, fl, ot in zip(static, floats, others):
    out, vjp = _vjp(st, fl, ot)
    outs.append(out)
    residuals.append((fl, ot) if st[3] else vjp)
  return outs, residuals


def _ordered_bwd(static, residuals, cts):
  grads = [None] * len(static)
  gate = cts[-1]
  for i in reversed(range(len(static))):
    # The residuals wait for `gate`: the next call's gradients (or, for the
    # last call, its own cotangents, else XLA would hoist what the VJP
    # recomputes from residuals into the forward's tail).
    res, ct, gate = jax.lax.optimization_barrier((residuals[i], cts[i], gate))
    vjp = _vjp(static[i], *res)[1] if static[i][3] else res
    (grads[i],) = vjp(ct)
    gate = grads[i]
  # The integer leaves get no gradient.
  return grads, [[None] * st[2].count(False) for st in static]


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
    changed = segment_ids[:, 1:] != segment_ids[:, :-1]
    runs = jnp.sum(changed, axis=1, dtype=jnp.int32)
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
