"""The xla gmm (ragged_dot_general) against jax.lax.ragged_dot; VJP through xla gmm/tgmm."""

import jax.numpy as jnp
import pytest

from tokamax_gdn import registry

from .cases import CASES, check_forward, check_vjp


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward(case):
  check_forward("xla", case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_vjp(case):
  check_vjp("xla", case)


def test_preferred_element_type():
  from .cases import SMALL, inputs  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.gmm.api import gmm  # pylint: disable=g-import-not-at-top
  lhs, rhs, gs = inputs(SMALL["bf16"])
  assert gmm(lhs, rhs, gs, preferred_element_type=jnp.float32,
             implementation="xla").dtype == jnp.float32


def test_vjp_uses_the_xla_family():
  impl = registry.get("gmm", "xla")
  assert impl.vjp is not None
