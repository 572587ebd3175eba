"""Every registered (op, implementation) against `reference`, on every
'conformance' spec the op declares. Registering an implementation adds it."""

import zlib

import jax
import jax.numpy as jnp
import pytest
from tokamax._src.ops import op as op_lib

from tokamax_gdn import registry
from tokamax_gdn.testing import conformance as conf
from tokamax_gdn.testing import draws
from tokamax_gdn.testing import specs as specs_lib
from tests import once

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
_EXPECTED = once.Once()


def _inputs_and_expected(op_name, spec):
  """(args, kwargs, diff, call, (out, grads)) of the reference on the spec's
  inputs: computed once per (op, spec) and shared by every implementation
  (on the chip, their tests run side by side: the first computes it)."""

  def compute():
    ref = registry.get(op_name, "reference")
    # A stable seed per spec (crc32, not hash(): that changes per process and
    # made failures unreproducible).
    args, kwargs = draws.draw(spec.make, zlib.crc32(spec.name.encode()) % 2**31)
    diff, call = conf.split_diff(spec, ref, args, kwargs)
    return args, kwargs, diff, call, conf.loss_and_grads(ref, call, diff, _CT_KEY)

  return _EXPECTED.get((op_name, spec.name), compute)


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


# Eager (op-by-op) dispatch compiles every primitive of an implementation on
# its own: tens of seconds per case for the chunked xla algebra and the
# interpret-mode kernels on the CI's 2 cores. Each (op, implementation) runs
# eagerly on its first spec (eager equals jit there) and, where the spec
# allows, under jit(vmap), each against the plain jit call with its arrays
# traced. Every spec runs under jit in test_forward_and_vjp_match_reference;
# here the plain jit call runs only as the eager or vmap check's baseline:
# another compile checking nothing more cost 41 CPU-s of interpret-mode
# compiles for the serving Pallas specs alone.
_EAGER = {}
for _op, _impl, _spec in CASES:
  _EAGER.setdefault((_op, _impl), _spec.name)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_jit_vmap_config_and_serialisation(case):
  op_name, impl_name, spec = case
  impl = registry.get(op_name, impl_name)
  args, kwargs = spec.make(jax.random.key(1))
  tol = specs_lib.tolerance(conf.lowest_float_dtype(args, kwargs), grad=False)
  with conf.execution_context(impl_name):
    conf.check_heuristics_in_space(impl, args, kwargs)
    conf.check_bound_args_roundtrip(impl, args, kwargs)
    kw_arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
    kw_static = {k: v for k, v in kwargs.items() if not hasattr(v, "shape")}
    eager = _EAGER[(op_name, impl_name)] == spec.name
    if not (eager or spec.vmap_ok):
      return
    run = jax.jit(lambda a, kw: impl(*a, **kw, **kw_static))
    jitted = run(args, kw_arrays)
    if eager:
      conf.assert_close(jitted, impl(*args, **kwargs), tol, f"{op_name}/{impl_name} jit")
    if spec.vmap_ok:
      args2, kwargs2 = spec.make(jax.random.key(2))
      kw2 = {k: kwargs2[k] for k in kw_arrays}
      stack = lambda x, y: jnp.stack([x, y])
      a_st = jax.tree.map(stack, args, args2)
      kw_st = jax.tree.map(stack, kw_arrays, kw2)
      batched = jax.jit(jax.vmap(lambda a, kw: impl(*a, **kw, **kw_static)))(a_st, kw_st)
      second = run(args2, kw2)
      conf.assert_close(jax.tree.map(lambda x: x[0], batched), jitted, tol,
                        f"{op_name}/{impl_name} vmap[0]")
      conf.assert_close(jax.tree.map(lambda x: x[1], batched), second, tol,
                        f"{op_name}/{impl_name} vmap[1]")
