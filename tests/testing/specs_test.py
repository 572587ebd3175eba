"""`tokamax_gdn.testing.specs`: the contract's error measure, in pieces on the host."""

import ml_dtypes
import numpy as np

from tokamax_gdn.testing import specs


def test_rel_rms_in_pieces_is_the_whole_arrays():
  rng = np.random.default_rng(0)
  e = rng.standard_normal(specs._CHUNK * 2 + 77).astype(np.float32)  # pylint: disable=protected-access
  a = e + 1e-3 * rng.standard_normal(e.shape).astype(np.float32)
  whole = np.sqrt(np.mean((a.astype(np.float64) - e) ** 2)) / np.sqrt(np.mean(e.astype(np.float64) ** 2))
  assert abs(specs.rel_rms(a, e) - whole) <= 1e-12 * whole
  b = a.astype(ml_dtypes.bfloat16)
  assert 1e-3 < specs.rel_rms(b, e) < 1e-2
  assert specs.rel_rms(np.zeros((0, 3)), np.zeros((0, 3))) == 0.0
  # Broadcast shapes still compare as before.
  assert specs.rel_rms(np.ones((2, 3)), np.ones(3)) == 0.0


def test_all_finite_finds_one_bad_element_in_any_piece():
  x = np.zeros(specs._CHUNK + 5, ml_dtypes.bfloat16)  # pylint: disable=protected-access
  assert specs.all_finite(x)
  x[-1] = np.inf
  assert not specs.all_finite(x)
  x[-1], x[3] = 0, np.nan
  assert not specs.all_finite(x)
  assert specs.all_finite(np.zeros(0))
