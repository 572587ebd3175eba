"""Forward-mode autodiff of the ops with a VJP: a TypeError that names the op.

(gated_delta_rule's own, for each of its implementations, is in
tests/ops/gated_delta_rule/base_test.py.)
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops import autodiff
from tokamax_gdn.testing import conformance


def _conv(impl):
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 8, 4)), jnp.float32)
  w = jnp.asarray(np.random.default_rng(1).standard_normal((4, 4)), jnp.float32)
  return lambda x: tokamax_gdn.causal_conv1d(x, w, activation=None, implementation=impl)[0], x


def _gmm(impl):
  lhs = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)
  rhs = jnp.asarray(np.random.default_rng(1).standard_normal((2, 8, 8)), jnp.float32)
  sizes = jnp.array([9, 7], jnp.int32)
  return lambda lhs: tokamax_gdn.gmm(lhs, rhs, sizes, implementation=impl), lhs


def _tgmm(impl):
  lhs = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32)
  rhs = jnp.asarray(np.random.default_rng(1).standard_normal((16, 8)), jnp.float32)
  sizes = jnp.array([9, 7], jnp.int32)
  return lambda lhs: tokamax_gdn.tgmm(lhs, rhs, sizes, implementation=impl), lhs


CASES = [(op, impl, make) for op, make in (("causal_conv1d", _conv), ("gmm", _gmm),
                                           ("tgmm", _tgmm))
         for impl in registry.implementations(op)]


@pytest.mark.parametrize("op_name,impl,make", CASES, ids=[f"{o}-{i}" for o, i, _ in CASES])
def test_forward_mode_names_the_op_or_is_right(op_name, impl, make):
  """Each case is linear in x (no activation, no bias), so a JVP that works
  must give f(x) as the tangent along x; one that cannot must say so by name."""
  f, x = make(impl)
  with conformance.execution_context(impl):
    try:
      _, tangent = jax.jvp(f, (x,), (x,))
    except autodiff.ForwardModeError as e:
      assert f"{op_name} does not support forward-mode" in str(e)
    else:
      np.testing.assert_allclose(tangent, f(x), rtol=1e-5, atol=1e-5)
    assert jax.grad(lambda x: jnp.sum(f(x)))(x).shape == x.shape   # reverse mode works
