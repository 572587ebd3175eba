"""The reference tgmm (masked per-group loop) against jax.lax.ragged_dot_general."""

import pytest

from .cases import CASES, check_forward, check_vjp


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_vjp(case):
  check_forward("reference", case)
  check_vjp("reference", case)
