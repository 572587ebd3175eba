"""Registry of ops, their implementations and their named workloads.

Each op lives in `tokamax_gdn/ops/<op>/`; each implementation in a module of
that folder named after it (`pallas_mosaic_tpu.py`, `xla.py`, `reference.py`)
which exposes its `tokamax.Op` instance as `IMPLEMENTATION`. The registry
discovers those modules, so an implementation joins the registry (and the
conformance suite) by existing, with no list to edit; a name whose module does
not exist is simply absent. Likewise each op's `arg_specs.py` holds its named
workloads (`arg_specs(op, tag)`).
"""

from collections.abc import Callable, Sequence
import importlib
import importlib.util
from typing import Any

from tokamax._src.ops import op as op_lib

from tokamax_gdn import autotuning
from tokamax_gdn import config

OPS: tuple[str, ...] = ("gated_delta_rule", "causal_conv1d", "gmm", "tgmm",
                        "causal_conv1d_gated_delta_rule", "gated_rmsnorm")
IMPLEMENTATION_NAMES: tuple[str, ...] = ("pallas_mosaic_tpu", "xla", "reference")

_cache: dict[str, dict[str, op_lib.Op]] = {}


def list_ops() -> list[str]:
  """Names of the ops, in a fixed order."""
  return list(OPS)


def _check_op(op_name: str) -> None:
  if op_name not in OPS:
    raise ValueError(f"Unknown op {op_name!r}; valid ops: {', '.join(OPS)}")


def implementations(op_name: str) -> dict[str, op_lib.Op]:
  """Implementation name -> `tokamax.Op` instance for `op_name`."""
  _check_op(op_name)
  if op_name not in _cache:
    found = {}
    for name in IMPLEMENTATION_NAMES:
      module_name = f"tokamax_gdn.ops.{op_name}.{name}"
      if importlib.util.find_spec(module_name) is None:
        continue
      module = importlib.import_module(module_name)
      impl = getattr(module, "IMPLEMENTATION", None)
      if not isinstance(impl, op_lib.Op):
        raise TypeError(f"{module_name}.IMPLEMENTATION must be a tokamax Op, got {impl!r}")
      found[name] = impl
    _cache[op_name] = found
  return dict(_cache[op_name])


def get(op_name: str, name: str) -> op_lib.Op:
  """The `tokamax.Op` registered for (`op_name`, `name`)."""
  impls = implementations(op_name)
  if name not in impls:
    raise ValueError(
        f"Unknown implementation {name!r} for op {op_name!r}; valid: {', '.join(impls)}"
    )
  return impls[name]


def default_order(op_name: str) -> tuple[str, ...]:
  """Implementation names tried when `implementation=None`.

  On TPU (a real chip, or an abstract TPU mesh when compiling ahead of time)
  the Pallas kernels come first; elsewhere `xla` then `reference`.
  """
  impls = implementations(op_name)
  order = IMPLEMENTATION_NAMES if config.on_tpu() else ("xla", "reference")
  return tuple(n for n in order if n in impls)


Implementation = str | op_lib.Op | Sequence[str | op_lib.Op] | None


def for_op(implementation: Implementation | dict[str, Implementation], op_name: str
           ) -> Implementation:
  """One op's `implementation=` out of a layer's or model's: a name, a
  sequence, or {op name: either} (an op it does not name gets None)."""
  if isinstance(implementation, dict):
    return implementation.get(op_name)
  return implementation


def candidates(op_name: str, implementation: Implementation) -> tuple[str | op_lib.Op, ...]:
  """An `implementation=` argument as the names and Ops to try, in order
  (None: `default_order`). TypeError for anything but None, a name, an Op or
  a non-empty sequence (list, tuple) of names and Ops (ValueError for an empty one),
  naming the valid names; an unknown name is left to `get`."""
  if implementation is None:
    return default_order(op_name)
  if isinstance(implementation, (str, op_lib.Op)):
    return (implementation,)
  if not isinstance(implementation, Sequence):
    raise _implementation_type_error(op_name, implementation, "")
  for item in implementation:
    if not isinstance(item, (str, op_lib.Op)):
      raise _implementation_type_error(op_name, item, " element")
  if not implementation:
    raise ValueError("`implementation` must not be an empty sequence.")
  return tuple(implementation)


def _implementation_type_error(op_name: str, value: Any, what: str) -> TypeError:
  return TypeError(
      f"`implementation`{what} {value!r} ({type(value).__name__}) for op {op_name!r}: expected"
      f" an implementation name ({', '.join(map(repr, implementations(op_name)))}), a"
      " tokamax Op, a sequence of those (tried in order), or None (the best for the"
      " backend).")


def resolve(op_name: str, implementation: Implementation) -> list[op_lib.Op]:
  """Turns an `implementation=` argument into the list of Ops to try, in order."""
  return [n if isinstance(n, op_lib.Op) else get(op_name, n)
          for n in candidates(op_name, implementation)]


def call(
    op_name: str,
    implementation: Implementation,
    *args,
    **kwargs,
) -> Any:
  """Calls the first implementation that does not raise NotImplementedError.

  Raises:
    ValueError: for an unknown implementation name (before anything runs).
    NotImplementedError (or any error of its own): from a single named
      implementation (a str or an Op), as it raised it.
    ExceptionGroup: when every implementation of a sequence (or of the
      default order, `implementation=None`) raised NotImplementedError.
  """
  return call_each(op_name, implementation, lambda impl: impl(*args, **kwargs))


def call_each(op_name: str, implementation: Implementation, fn: Callable[[Any], Any]) -> Any:
  """`fn(impl)` for the implementations in order, up to the first that does
  not raise NotImplementedError (`call` with a caller's own way to call); a
  single named implementation (a str or an Op) raises its own error."""
  if isinstance(implementation, (str, op_lib.Op)):
    return fn(resolve(op_name, implementation)[0])
  errors = []
  for impl in resolve(op_name, implementation):
    try:
      return fn(impl)
    except NotImplementedError as e:
      errors.append(e)
  raise ExceptionGroup(f"all implementations of {op_name} failed", errors)


def table() -> list[tuple[str, str, str, str]]:
  """Rows (op, implementation, Op class, Config class) for printing."""
  rows = []
  for op_name in OPS:
    for name, impl in implementations(op_name).items():
      cfg = type(impl).config_cls
      rows.append((op_name, name, type(impl).__name__, getattr(cfg, "__name__", str(cfg))))
  return rows


def arg_specs(op_name: str, tag: str | None = None) -> list[autotuning.ArgSpec]:
  """The op's specs (from `tokamax_gdn.ops.<op>.arg_specs`), optionally by tag."""
  module = importlib.import_module(f"tokamax_gdn.ops.{op_name}.arg_specs")
  specs = list(module.ARG_SPECS)
  return [s for s in specs if tag is None or tag in s.tags]


__all__ = ["list_ops", "implementations", "get", "default_order", "for_op", "candidates",
           "resolve", "call", "call_each", "table", "arg_specs"]
