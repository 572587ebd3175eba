"""The reference tgmm (masked per-group loop) against jax.lax.ragged_dot_general."""

import pytest

from .cases import CASES, check_forward, check_vjp


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_vjp(case):
  # The reference multiplies masked rows by zero: inf/NaN past the groups
  # would leak (0 * inf), so it is checked on finite inputs.
  check_forward("reference", case, garbage_tail=False)
  check_vjp("reference", case)
