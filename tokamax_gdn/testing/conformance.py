"""Conformance checks every registered implementation must pass.

`tests/conformance_test.py` parametrises these over every (op, implementation)
in the registry and every 'conformance' ArgSpec the op declares, so a new
implementation is tested by registering it. Pallas TPU implementations run in
interpret mode off TPU, on the specs also tagged 'interpret' (interpret mode
is slow; the op's own tests cover more shapes).
"""

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op as op_lib

from tokamax_gdn import autotuning
from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.testing import specs as specs_lib

INTERPRETED = "pallas_mosaic_tpu"


def cases() -> list[tuple[str, str, autotuning.ArgSpec]]:
  """(op, implementation, spec) triples to check."""
  out = []
  for op_name in registry.list_ops():
    try:
      all_specs = registry.arg_specs(op_name, "conformance")
    except ModuleNotFoundError:
      all_specs = []
    for impl_name in registry.implementations(op_name):
      for spec in all_specs:
        if impl_name == INTERPRETED and not config.on_tpu() and "interpret" not in spec.tags:
          continue
        out.append((op_name, impl_name, spec))
  return out


def impl_pairs() -> list[tuple[str, str]]:
  return [(o, i) for o in registry.list_ops() for i in registry.implementations(o)]


def execution_context(impl_name: str):
  """Interpret mode for Pallas TPU kernels when not on a TPU."""
  if impl_name == INTERPRETED and not config.on_tpu():
    return config.interpret_mode(True)
  return contextlib.nullcontext()


def lowest_float_dtype(args, kwargs) -> Any:
  dts = [x.dtype for x in jax.tree.leaves((args, kwargs))
         if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)]
  return min(dts, key=lambda d: jnp.finfo(d).bits) if dts else jnp.float32


def _leaves(tree):
  return [x for x in jax.tree.leaves(tree) if x is not None]


def assert_close(actual, expected, tol: float, what: str) -> None:
  a_leaves, e_leaves = _leaves(actual), _leaves(expected)
  assert len(a_leaves) == len(e_leaves), f"{what}: {len(a_leaves)} vs {len(e_leaves)} leaves"
  for i, (a, e) in enumerate(zip(a_leaves, e_leaves)):
    assert a.shape == e.shape, f"{what}[{i}]: shape {a.shape} vs {e.shape}"
    if not a.size:   # empty specs: the shape is the result
      continue
    assert specs_lib.all_finite(a), f"{what}[{i}]: non-finite values"
    err = specs_lib.rel_rms(a, e)
    assert err <= tol, f"{what}[{i}]: rel-RMS {err:.3g} > {tol:.3g}"


def split_diff(spec: autotuning.ArgSpec, op: op_lib.Op, args, kwargs):
  """Splits the call into differentiable float arrays (by name) and the rest."""
  ba = op.signature.bind(*args, **kwargs)
  diff = {n: v for n, v in ba.arguments.items()
          if n in spec.diff_argnames and v is not None and hasattr(v, "dtype")
          and jnp.issubdtype(v.dtype, jnp.floating)}

  def call(impl, diff_args):
    arguments = dict(ba.arguments) | diff_args
    bound = op.signature.bind_partial()
    bound.arguments.update(arguments)
    return impl(*bound.args, **bound.kwargs)

  return diff, call


def loss_and_grads(impl, call, diff, cotangent_key=None, *, cotangents=None):
  """Forward output and grads of <out, random cotangent> w.r.t. `diff`.

  The cotangents are drawn from `cotangent_key` in the program, or given:
  `cotangents`, one float32 array per output leaf (not None), as arguments of
  a compiled program. Drawn in the program, a large one costs the TPU
  compiler seconds (libtpu's code generation for the RNG with the backward
  it feeds), where an argument costs nothing.

  Jitted: one compile per case rather than op-by-op dispatch (several times
  cheaper at conformance shapes), and the way the ops run in models."""
  def loss(d):
    out = call(impl, d)
    leaves = _leaves(out)
    if cotangents is None:
      keys = jax.random.split(cotangent_key, len(leaves))
      cts = [jax.random.normal(k, leaf.shape) for k, leaf in zip(keys, leaves)]
    else:
      cts = list(cotangents)
      if [c.shape for c in cts] != [leaf.shape for leaf in leaves]:
        raise ValueError(f"cotangents {[c.shape for c in cts]} do not match the outputs "
                         f"{[leaf.shape for leaf in leaves]}")
    return sum(jnp.sum(leaf.astype(jnp.float32) * ct) for ct, leaf in zip(cts, leaves)), out
  (_, out), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
  return out, grads


def check_config_class(impl: op_lib.Op) -> None:
  cfg = type(impl).config_cls
  if cfg is op_lib.NullConfig:
    return
  assert dataclasses.is_dataclass(cfg), f"{cfg} is not a dataclass"
  assert cfg.__dataclass_params__.frozen, f"{cfg} must be frozen"
  assert pydantic.dataclasses.is_pydantic_dataclass(cfg), f"{cfg} must be a pydantic dataclass"


def check_heuristics_in_space(impl: op_lib.Op, args, kwargs) -> None:
  ops = [impl] + ([impl.vjp] if isinstance(impl.vjp, op_lib.Op) else [])
  ba = impl.bind(*args, **kwargs)
  for o in ops:
    if type(o).config_cls is op_lib.NullConfig:
      continue
    if o is not impl:
      ba_o = op_lib.BoundArguments(o, ba.vjp_arg_spec)
    else:
      ba_o = ba
    heuristics = ba_o.heuristics_config
    hash(heuristics)
    space = o._get_autotuning_configs(ba_o)  # pylint: disable=protected-access
    assert heuristics in space, f"{type(o).__name__}: heuristics {heuristics} not in {space}"


def check_bound_args_roundtrip(impl: op_lib.Op, args, kwargs) -> None:
  op = impl.replace(vjp=None)
  ba = op.bind(*args, **kwargs)
  abstract = op_lib._abstractify(dict(ba.arguments))  # pylint: disable=protected-access
  ba = op_lib.BoundArguments(op, abstract)
  adapter = op_lib.BOUND_ARGS_ADAPTER
  ba2 = adapter.validate_json(adapter.dump_json(ba))
  assert ba == ba2.replace(op=ba2.op.replace(vjp=None)), (ba, ba2)
