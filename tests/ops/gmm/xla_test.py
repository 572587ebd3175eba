"""The xla gmm (ragged_dot_general) against jax.lax.ragged_dot; VJP through xla gmm/tgmm."""

import jax
import jax.numpy as jnp
import pytest
from tokamax._src import hlo_utils

from tokamax_gdn import registry

from .cases import CASES, SMALL, check_forward, check_vjp, inputs


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_vjp(case):
  check_forward("xla", case)
  check_vjp("xla", case)


def test_preferred_element_type():
  from tokamax_gdn.ops.gmm.api import gmm  # pylint: disable=g-import-not-at-top
  lhs, rhs, gs = inputs(SMALL["bf16"])
  assert gmm(lhs, rhs, gs, preferred_element_type=jnp.float32,
             implementation="xla").dtype == jnp.float32


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_vjp_uses_the_xla_family(transpose_rhs):
  """The backward runs xla gmm (dlhs) and xla tgmm (drhs), nothing else."""
  case = SMALL["f32_transposed" if transpose_rhs else "f32_zeros_sum_lt_m"]
  lhs, rhs, gs = inputs(case)
  loss = lambda a, b: jnp.sum(registry.get("gmm", "xla")(a, b, gs, transpose_rhs=transpose_rhs))
  found = hlo_utils.get_bound_args(jax.grad(loss, argnums=(0, 1)), lhs, rhs)
  calls = sorted((type(ba.op).__name__, ba.kwargs.get("transpose_rhs")) for ba in found)
  # The forward, dlhs = gmm(dout, rhs) in the flipped layout, drhs = tgmm(...).
  assert calls == [("XlaGmm", False), ("XlaGmm", True), ("XlaTgmm", None)]
