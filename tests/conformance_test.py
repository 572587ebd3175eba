"""Every registered (op, implementation) against `reference`, on every
'conformance' spec the op declares. Registering an implementation adds it."""

import zlib

import jax
import jax.numpy as jnp
import pytest
from tokamax._src.ops import op as op_lib

from tokamax_gdn import registry
from tokamax_gdn.testing import conformance as conf
from tokamax_gdn.testing import specs as specs_lib

CASES = conf.cases()
PAIRS = conf.impl_pairs()
# Against the reference: every implementation but the reference itself (the
# same computation twice cannot differ; tests/ops/*/reference_test.py check
# the reference against independent formulations).
AGAINST_REFERENCE = [c for c in CASES if c[1] != "reference"]


def _id(case):
  op_name, impl_name, spec = case
  return f"{op_name}-{impl_name}-{spec.name}"


def test_every_op_has_reference_and_specs():
  for op_name in registry.list_ops():
    impls = registry.implementations(op_name)
    if not impls:
      continue
    assert "reference" in impls, op_name
    assert registry.arg_specs(op_name, "conformance"), op_name


@pytest.mark.parametrize("op_name,impl_name", PAIRS, ids=[f"{o}-{i}" for o, i in PAIRS])
def test_is_tokamax_op_with_valid_config(op_name, impl_name):
  impl = registry.get(op_name, impl_name)
  assert isinstance(impl, op_lib.Op)
  conf.check_config_class(impl)
  if isinstance(impl.vjp, op_lib.Op):
    conf.check_config_class(impl.vjp)


_CT_KEY = jax.random.key(7)
_EXPECTED = {}


def _inputs_and_expected(op_name, spec):
  """(args, kwargs, diff, call, (out, grads)) of the reference on the spec's
  inputs: computed once per (op, spec) and shared by every implementation."""
  key = (op_name, spec.name)
  if key not in _EXPECTED:
    ref = registry.get(op_name, "reference")
    # A stable seed per spec (crc32, not hash(): that changes per process and
    # made failures unreproducible).
    args, kwargs = spec.make(jax.random.key(zlib.crc32(spec.name.encode()) % 2**31))
    diff, call = conf.split_diff(spec, ref, args, kwargs)
    _EXPECTED[key] = args, kwargs, diff, call, conf.loss_and_grads(ref, call, diff, _CT_KEY)
  return _EXPECTED[key]


@pytest.mark.parametrize("case", AGAINST_REFERENCE, ids=_id)
def test_forward_and_vjp_match_reference(case):
  op_name, impl_name, spec = case
  impl = registry.get(op_name, impl_name)
  args, kwargs, diff, call, (expected, expected_grads) = _inputs_and_expected(op_name, spec)
  tol_f = specs_lib.tolerance(conf.lowest_float_dtype(args, kwargs), grad=False)
  tol_g = specs_lib.tolerance(conf.lowest_float_dtype(args, kwargs), grad=True)
  with conf.execution_context(impl_name):
    actual, grads = conf.loss_and_grads(impl, call, diff, _CT_KEY)
  conf.assert_close(actual, expected, tol_f, f"{op_name}/{impl_name} forward")
  for name in diff:
    conf.assert_close(grads[name], expected_grads[name], tol_g,
                      f"{op_name}/{impl_name} d{name}")


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_jit_vmap_config_and_serialisation(case):
  op_name, impl_name, spec = case
  impl = registry.get(op_name, impl_name)
  args, kwargs = spec.make(jax.random.key(1))
  tol = specs_lib.tolerance(conf.lowest_float_dtype(args, kwargs), grad=False)
  with conf.execution_context(impl_name):
    conf.check_heuristics_in_space(impl, args, kwargs)
    conf.check_bound_args_roundtrip(impl, args, kwargs)
    eager = impl(*args, **kwargs)
    kw_arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
    kw_static = {k: v for k, v in kwargs.items() if not hasattr(v, "shape")}
    jitted = jax.jit(lambda a, kw: impl(*a, **kw, **kw_static))(args, kw_arrays)
    conf.assert_close(jitted, eager, tol, f"{op_name}/{impl_name} jit")
    if spec.vmap_ok:
      args2, kwargs2 = spec.make(jax.random.key(2))
      stack = lambda x, y: jnp.stack([x, y])
      a_st = jax.tree.map(stack, args, args2)
      kw_st = jax.tree.map(stack, kw_arrays, {k: kwargs2[k] for k in kw_arrays})
      batched = jax.vmap(lambda a, kw: impl(*a, **kw, **kw_static))(a_st, kw_st)
      second = impl(*args2, **kwargs2)
      conf.assert_close(jax.tree.map(lambda x: x[0], batched), eager, tol,
                        f"{op_name}/{impl_name} vmap[0]")
      conf.assert_close(jax.tree.map(lambda x: x[1], batched), second, tol,
                        f"{op_name}/{impl_name} vmap[1]")
