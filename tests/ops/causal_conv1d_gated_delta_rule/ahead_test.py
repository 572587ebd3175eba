"""`test_base.compute_ahead`: oracles computed in threads ahead of the tests
(the on-chip tier's named workloads) are the ones `expected` returns, an
oracle's failure there is raised in the test that wants it, and an
implementation warmed there is not compiled again by the test's call."""

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
    assert test_base._AHEAD["ahead_broken"].oracle.exception() is raised.value  # pylint: disable=protected-access
  finally:
    test_base.stop_ahead(pool)


class _Xla(test_base.ServingTestBase):
  IMPL = "xla"


def test_implementations_warmed_ahead_are_not_compiled_again():
  (cid, lay) = CASES[0]
  cid = cid + "_warm"
  pool = test_base.compute_ahead([(cid, lay)], workers=1, warm={cid: ["xla"]},
                                 call=_Xla().call)
  try:
    test_base.wait_warm(cid, "xla")
    (args, kwargs), _, _ = test_base.expected(cid, lay, *test_base.tokamax_oracle(lay))
  finally:
    test_base.stop_ahead(pool)
  static = tuple(sorted((k, v) for k, v in kwargs.items() if k in test_base.STATIC))
  (fn,) = [f for key, f in test_base._JITTED.items()  # pylint: disable=protected-access
           if key[0] == "xla" and key[2] == static]
  assert fn._cache_size() == 1   # pylint: disable=protected-access
  _Xla()._check_against_ours_and_tokamax(cid, lay, *test_base.tokamax_oracle(lay))  # pylint: disable=protected-access
  assert fn._cache_size() == 1   # pylint: disable=protected-access
