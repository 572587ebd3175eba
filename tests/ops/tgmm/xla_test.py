"""The xla tgmm (ragged_dot_general) against float32 ragged_dot_general; VJP via xla gmm."""

import pytest

from .cases import CASES, check_forward, check_vjp


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_vjp(case):
  check_forward("xla", case)
  check_vjp("xla", case)
