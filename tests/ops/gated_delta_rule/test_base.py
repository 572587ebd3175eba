"""The GDN test harness: inputs, one forward+backward run, one comparison
against `reference` with the numerical contract's tolerances (testing/specs.py).

Every GDN test that builds inputs or checks an implementation against the
reference uses these (xla_test, stress_test, property_test, decode_test,
sharding_checks, segment_states_test, isolation_test; the Pallas tests may).
An implementation is a registered name or a `tokamax.Op` (for a fixed
config: `with_config`); interpret mode is automatic for the Pallas TPU
implementation off TPU (`interpret=None`), or forced on / off.

  diff, static = inputs(0, b=1, t=65, hk=1, hv=2, dk=16, dv=8)
  check_against_reference(with_config("xla", chunk_size=32), diff, static)
"""

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import arg_specs
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.testing import conformance
from tokamax_gdn.testing.specs import rel_rms, tolerance

OP = "gated_delta_rule"
POSITIONAL = ("query", "key", "value", "g", "beta")
DIFF_KWARGS = ("initial_state", "a_log", "dt_bias")

Impl = str | Any    # a registered implementation name or a tokamax Op


def split(args, kwargs) -> tuple[dict, dict]:
  """(diff, static) from `random_inputs`-style (args, kwargs): the arrays
  gradients are taken for, by name, and the other keyword arguments."""
  diff = dict(zip(POSITIONAL, args))
  static = dict(kwargs)
  for name in DIFF_KWARGS:
    if static.get(name) is not None:
      diff[name] = static.pop(name)
  static.pop("initial_state", None)
  return diff, static


def inputs(seed: int, **options) -> tuple[dict, dict]:
  """`arg_specs.random_inputs` (key `seed`, shapes and options as there) split
  into (diff, static); the final state is always returned."""
  args, kwargs = arg_specs.random_inputs(jax.random.key(seed), **options)
  diff, static = split(args, kwargs)
  static["output_final_state"] = True
  return diff, static


def with_config(impl: Impl, **fields) -> Impl:
  """`impl` with its forward and VJP configs set to `fields` (e.g.
  chunk_size=32, block_size=256); unchanged if its Config has none of them
  (`reference`). VJP-only fields: pass `vjp={...}`."""
  vjp_fields = fields.pop("vjp", {})
  op = registry.get(OP, impl) if isinstance(impl, str) else impl
  cfg_cls = type(op).config_cls
  names = getattr(cfg_cls, "__dataclass_fields__", {})
  if not set(fields) & set(names):
    return impl
  cfg = cfg_cls(**fields)
  vjp = op.vjp
  if dataclasses.is_dataclass(vjp) and type(vjp).config_cls is cfg_cls:
    vjp = vjp.replace(config=cfg_cls(**{**fields, **vjp_fields}))
  return op.replace(config=cfg, vjp=vjp)


def _name(impl: Impl) -> str:
  if isinstance(impl, str):
    return impl
  for name, op in registry.implementations(OP).items():
    if type(op) is type(impl):
      return name
  return type(impl).__name__


def context(impl: Impl, interpret: bool | None = None):
  """Interpret mode for `impl`: automatic (None), or forced on / off."""
  if interpret is None:
    return conformance.execution_context(_name(impl))
  return config.interpret_mode(interpret) if interpret else contextlib.nullcontext()


def call(impl: Impl, diff: dict, static: dict, *, interpret: bool | None = None):
  """gated_delta_rule(**diff, **static, implementation=impl) -> (out, final)."""
  d = dict(diff)
  with context(impl, interpret):
    return gated_delta_rule(*[d.pop(n) for n in POSITIONAL], **d, **static,
                            implementation=impl)


def cotangents(diff: dict, static: dict, seed: int = 99):
  """Random cotangents for (out, final_state) (final None without one)."""
  shapes = jax.eval_shape(lambda d: call("reference", d, static), diff)
  keys = jax.random.split(jax.random.key(seed), 2)
  out = jax.random.normal(keys[0], shapes[0].shape).astype(shapes[0].dtype)
  final = None if shapes[1] is None else jax.random.normal(keys[1], shapes[1].shape)
  return out, final


def _static_key(static: dict) -> tuple[dict, tuple]:
  """(array-valued keyword arguments, the others as a hashable tuple)."""
  arrays = {n: x for n, x in static.items() if isinstance(x, (jax.Array, np.ndarray))}
  return arrays, tuple(sorted((n, x) for n, x in static.items() if n not in arrays))


@functools.cache
def _fwd_bwd_fn(impl: Impl, static_key: tuple, interpret: bool | None):
  """One jitted forward+VJP per implementation, non-array keyword arguments
  and interpret setting (tests reuse it across inputs of one shape)."""
  del interpret  # part of the cache key: it is read while tracing
  static = dict(static_key)

  def f(d, arrays):
    d = dict(d)
    return gated_delta_rule(*[d.pop(n) for n in POSITIONAL], **d, **static, **arrays,
                            implementation=impl)

  @jax.jit
  def run(d, arrays, cts):
    (out, final), vjp = jax.vjp(lambda d: f(d, arrays), d)
    return out, final, vjp(cts)[0]

  return run


def fwd_bwd(impl: Impl, diff: dict, static: dict, cts=None, *, seed: int = 99,
            interpret: bool | None = None):
  """(out, final_state, grads by name) of the call, its VJP applied to `cts`
  (random from `seed` when None), under jit."""
  cts = cotangents(diff, static, seed) if cts is None else cts
  arrays, static_key = _static_key(static)
  run = _fwd_bwd_fn(impl, static_key, interpret)
  with context(impl, interpret):
    return jax.block_until_ready(run(diff, arrays, cts))


def errors(got, want) -> dict[str, float]:
  """rel-RMS of out, final state and every gradient of two `fwd_bwd` results."""
  (out, final, grads), (w_out, w_final, w_grads) = got, want
  errs = {"out": rel_rms(out, w_out)}
  if w_final is not None:
    errs["final_state"] = rel_rms(final, w_final)
  assert set(grads) == set(w_grads), (set(grads), set(w_grads))
  for name, g in w_grads.items():
    errs["d_" + name] = rel_rms(grads[name], g)
  return errs


def assert_finite(tree, what: str = "") -> None:
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    x = np.asarray(jnp.asarray(x, jnp.float32))
    assert np.isfinite(x).all(), f"{what}{jax.tree_util.keystr(path)} has NaN/inf"


def assert_close(got, want, dtype, what: str = "") -> dict[str, float]:
  """Every result of `got` finite and within the contract's tolerance for
  `dtype` (2e-4 / 2e-3 gradients in float32, 2e-2 in bfloat16) of `want`."""
  assert_finite(got, what)
  errs = errors(got, want)
  tol = {n: tolerance(dtype, grad=n.startswith("d_")) for n in errs}
  bad = {n: (e, tol[n]) for n, e in errs.items() if not e <= tol[n]}
  assert not bad, f"{what}: rel-RMS over tolerance {bad} (all: {errs})"
  return errs


def check_against_reference(impl: Impl, diff: dict, static: dict, *, cts=None,
                            seed: int = 99, interpret: bool | None = None,
                            upcast_reference: bool = False, what: str = ""):
  """Runs `impl` and `reference` (on float32 copies of the inputs with
  `upcast_reference`), forward and backward with the same cotangents, and
  asserts the contract; also that out keeps value's dtype and the state is
  float32. Returns (got, want)."""
  cts = cotangents(diff, static, seed) if cts is None else cts
  got = fwd_bwd(impl, diff, static, cts, interpret=interpret)
  ref_diff = diff
  if upcast_reference:
    ref_diff = {n: x.astype(jnp.float32) for n, x in diff.items()}
  want = fwd_bwd("reference", ref_diff, static, cts)
  dtype = diff["value"].dtype
  assert got[0].dtype == dtype, (got[0].dtype, dtype)
  assert got[1] is None or got[1].dtype == jnp.float32
  assert_close(got, want, dtype, what or _name(impl))
  return got, want


def segment_ids(t: int, starts, rows: int = 1) -> jax.Array:
  """[rows, t] ids with a new segment at each position in `starts`."""
  ids = np.zeros((rows, t), np.int32)
  for i, s in enumerate(starts):
    ids[:, s:] = i + 1
  return jnp.asarray(ids)
