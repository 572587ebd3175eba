"""`test_base.compute_ahead`: oracles computed in threads ahead of the tests
(the on-chip tier's named workloads) are the ones `expected` returns, and an
oracle's failure there is raised in the test that wants it."""

import jax
import numpy as np
import pytest

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

from . import test_base  # pylint: disable=relative-beyond-top-level

CASES = [
    ("ahead_mixed", arg_specs.layout(lengths=[1, 1, 7], context_lens=[2, 2, 0], max_reqs=4,
                                     **test_base.TINY, **test_base.F32)),
    # Verify windows: tokamax's eager, token-by-token oracle, in a thread.
    ("ahead_windows", arg_specs.layout(lengths=[4, 2, 1], context_lens=9, num_spec_tokens=3,
                                       max_reqs=4, **test_base.TINY)),
]


def _bits(tree):
  return [test_base._bits(x) for x in jax.tree.leaves(tree)]  # pylint: disable=protected-access


def test_oracles_computed_ahead_are_what_expected_returns():
  pool = test_base.compute_ahead(CASES, workers=2)
  try:
    got = {cid: test_base.expected(cid, lay, *test_base.tokamax_oracle(lay))
           for cid, lay in CASES}
  finally:
    test_base.stop_ahead(pool)
  for cid, lay in CASES:
    # The same case computed here, in this thread, under another id.
    here = test_base.expected(cid + "_here", lay, *test_base.tokamax_oracle(lay))
    (args, _), theirs, ours = got[cid]
    (args_here, _), theirs_here, ours_here = here
    for a, b in zip(_bits((args, theirs, ours)), _bits((args_here, theirs_here, ours_here))):
      np.testing.assert_array_equal(a, b)


def test_an_oracle_failing_ahead_fails_the_test_that_wants_it():
  lay = dict(CASES[0][1])
  lay["qkv"] = lay["qkv"].update(shape=(3, 5))     # fewer tokens than query_start_loc says
  pool = test_base.compute_ahead([("ahead_broken", lay)], workers=1)
  try:
    with pytest.raises(Exception) as raised:
      test_base.expected("ahead_broken", lay, *test_base.tokamax_oracle(lay))
    # Raised there, in the thread, and handed over here.
    assert test_base._AHEAD["ahead_broken"].exception() is raised.value  # pylint: disable=protected-access
  finally:
    test_base.stop_ahead(pool)
