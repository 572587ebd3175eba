"""Batch/head partitioning for Mosaic kernels under `jax.jit` with sharded inputs.

XLA cannot split a Mosaic custom call across devices by itself ("cannot be
automatically partitioned"). A GDN kernel is independent per batch row and per
key head (with its whole group of value heads), so `per_batch_and_head` wraps
a kernel call in `custom_partitioning` with a Shardy rule saying exactly that:
the batch factor `b` and the key-head factor `h` may be sharded, everything
else (time, head dims, the heads within a GVA group) is replicated first.
Each device then runs the kernel on its own rows and heads.

Dimension labels are space-separated factor names per operand and result:
`b` batch, `h` key heads (or another axis whose slices are independent, e.g.
conv channels), `hv` value heads (= `(h g)`, g = heads per group), `t` time,
anything else a dimension that must not be split.

Inputs sharded along any other dimension are gathered first, with a one-time
warning: for the time axis T the sharded method is context parallelism
(`context_parallel_axis=` inside `jax.shard_map`), which a partitioning rule
cannot express (it needs collectives between the shards).
"""

from collections.abc import Callable, Sequence
import warnings

import jax
from jax._src.interpreters import batching
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

_SHARDABLE = ("b", "h")


def _rule_labels(labels: str, key_heads: int, group: int) -> str:
  """Labels in Shardy's notation: value heads as the compound (h g).

  Shardy rejects size-1 factors inside a compound: with one group per value
  head they are `h` itself; with a single key head, a factor of their own.
  """
  hv = "h" if group == 1 else "hv" if key_heads == 1 else "(h g)"
  return " ".join(hv if d == "hv" else d for d in labels.split())


def _spec(sharding, ndim: int) -> tuple:
  spec = tuple(getattr(sharding, "spec", ()) or ())
  return spec + (None,) * (ndim - len(spec))


_warned: set[tuple[frozenset[str], tuple[str, ...]]] = set()


def _warn_gathered(arg_shapes, in_labels: Sequence[str]) -> None:
  """Warns once per kernel signature (labels) and gathered dimensions."""
  gathered = frozenset(
      d for shape, labels in zip(arg_shapes, in_labels)
      for d, ax in zip(labels.split(), _spec(shape.sharding, len(shape.shape)))
      if ax is not None and d not in (*_SHARDABLE, "hv"))
  key = (gathered, tuple(in_labels))
  if not gathered or key in _warned:
    return
  _warned.add(key)
  hint = (" For the sequence axis, shard T inside jax.shard_map and pass"
          " context_parallel_axis= to the op (docs/sharding.md, 'Long context')."
          if "t" in gathered else "")
  warnings.warn(
      f"A Pallas tokamax_gdn kernel got inputs sharded along dimension(s)"
      f" {sorted(gathered)} it needs whole on each device (labels: {list(in_labels)});"
      f" gathering them, so every device holds and computes the whole of those"
      f" dimensions.{hint}", stacklevel=2)


def per_batch_and_head(
    fn: Callable[..., tuple[jax.Array, ...]],
    in_labels: Sequence[str],
    out_labels: Sequence[str],
    *,
    key_heads: int,
    group: int,
) -> Callable[..., tuple[jax.Array, ...]]:
  """`fn(*arrays) -> tuple of arrays`, partitioned over batch and key heads.

  `fn` must compute its tiling from the (per-shard) shapes it is given. Under
  `vmap` (no batching rule for `custom_partitioning`) `fn` is returned as is.
  """
  rule = (", ".join(_rule_labels(l, key_heads, group) for l in in_labels) + " -> "
          + ", ".join(_rule_labels(l, key_heads, group) for l in out_labels))
  # Every factor but b and h, in order of first appearance (Shardy wants the
  # special factors' indices sorted).
  factors = dict.fromkeys(rule.replace("(", " ").replace(")", " ")
                          .replace(",", " ").replace("->", " ").split())
  replicated = tuple(f for f in factors if f not in _SHARDABLE)

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    _warn_gathered(arg_shapes, in_labels)
    axes = dict.fromkeys(_SHARDABLE)
    for shape, labels in zip(arg_shapes, in_labels):
      for d, ax in zip(labels.split(), _spec(shape.sharding, len(shape.shape))):
        key = "h" if d == "hv" else d
        if key in axes and axes[key] is None and ax is not None:
          axes[key] = ax

    def sharding(labels):
      return NamedSharding(mesh, P(*(axes.get("h" if d == "hv" else d)
                                     for d in labels.split())))

    return (mesh, fn, tuple(sharding(l) for l in out_labels),
            tuple(sharding(l) for l in in_labels))

  wrapped = custom_partitioning(fn)
  # Sizes of the factors used only inside the compound (h g).
  kwargs = {}
  if "(h g)" in rule:
    kwargs["g"] = group
    if "h" not in rule.replace("(h g)", "").replace(",", " ").split():
      kwargs["h"] = key_heads
  wrapped.def_partition(partition, sharding_rule=rule,
                        need_replication_factors=replicated, **kwargs)

  def call(*arrays):
    if any(isinstance(x, batching.BatchTracer) for x in arrays):
      return fn(*arrays)
    return wrapped(*arrays)

  return call


def call_per_shard(
    body: Callable[..., Sequence[jax.Array | None]],
    arrays: dict[str, jax.Array | None],
    labels: dict[str, str],
    out_labels: Sequence[str],
    *,
    key_heads: int,
    group: int = 1,
) -> tuple[jax.Array, ...]:
  """`body(**arrays)` through `per_batch_and_head`.

  Absent (None) operands stay out of the partitioned call and reach `body` as
  None; None results are dropped (`out_labels` label the others).
  """
  names = [n for n, x in arrays.items() if x is not None]

  def fn(*xs):
    kw = dict.fromkeys(arrays)
    kw.update(zip(names, xs))
    return tuple(x for x in body(**kw) if x is not None)

  run = per_batch_and_head(fn, [labels[n] for n in names], out_labels,
                           key_heads=key_heads, group=group)
  return run(*(arrays[n] for n in names))
