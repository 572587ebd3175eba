"""gmm / tgmm argument checks (shared by every implementation): errors name the argument."""

import jax
import jax.numpy as jnp
import pytest

from tokamax_gdn.ops.gmm import base
from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.tgmm.api import tgmm

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16


def _gmm_bind(lhs, rhs, gs, **kw):
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  return registry.get("gmm", "reference").bind(lhs, rhs, gs, **kw)


def _tgmm_bind(lhs, rhs, gs, **kw):
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  return registry.get("tgmm", "reference").bind(lhs, rhs, gs, **kw)


GS = S((4,), jnp.int32)


@pytest.mark.parametrize("args,kw,exc,words", [
    ((S((8, 16, 1), F32), S((4, 16, 8), F32), GS), {}, ValueError, ["`lhs`", "rank 2"]),
    ((S((8, 16), F32), S((16, 8), F32), GS), {}, ValueError, ["`rhs`", "rank 3"]),
    ((S((8, 16), F32), S((4, 12, 8), F32), GS), {}, ValueError, ["`rhs`", "K=16", "12"]),
    ((S((8, 16), F32), S((4, 8, 12), F32), GS), dict(transpose_rhs=True), ValueError,
     ["`rhs`", "[G, N, K]"]),
    ((S((8, 16), F32), S((4, 16, 8), F32), S((3,), jnp.int32)), {}, ValueError,
     ["`group_sizes`", "(4,)"]),
    ((S((8, 16), F32), S((4, 16, 8), F32), S((4,), F32)), {}, TypeError,
     ["`group_sizes`", "integer"]),
    ((S((8, 16), F32), S((4, 16, 8), F32), S((2, 2), jnp.int32)), {}, ValueError,
     ["`group_sizes`", "rank 1"]),
    ((S((8, 16), jnp.int32), S((4, 16, 8), F32), GS), {}, TypeError, ["`lhs`", "int8"]),
    ((S((8, 16), F32), S((4, 16, 8), jnp.bool_), GS), {}, TypeError, ["`rhs`"]),
])
def test_gmm_errors_name_the_argument(args, kw, exc, words):
  with pytest.raises(exc) as e:
    _gmm_bind(*args, **kw)
  for w in words:
    assert w in str(e.value)


def test_gmm_unsupported_ragged_dot_keywords_are_not_implemented():
  args = (S((8, 16), F32), S((4, 16, 8), F32), GS)
  with pytest.raises(NotImplementedError, match="activation"):
    _gmm_bind(*args, activation=jax.nn.relu)
  with pytest.raises(NotImplementedError, match="group_offset"):
    _gmm_bind(*args, group_offset=jnp.zeros((1,), jnp.int32))


def test_gmm_defaults():
  ba = _gmm_bind(S((8, 16), jnp.int8), S((4, 16, 8), BF16), GS)
  assert ba.kwargs["preferred_element_type"] == BF16 and not ba.kwargs["transpose_rhs"]
  ba = _gmm_bind(S((8, 16), jnp.float8_e4m3fn), S((4, 16, 8), BF16), GS)
  assert ba.kwargs["preferred_element_type"] == BF16
  ba = _gmm_bind(S((8, 16), BF16), S((4, 16, 8), F32), GS)
  assert ba.kwargs["preferred_element_type"] == F32
  assert base.compute_dtype(BF16, F32) == BF16
  assert base.compute_dtype(jnp.int8, F32) == F32
  assert base.compute_dtype(F32, F32) == F32


@pytest.mark.parametrize("args,exc,words", [
    ((S((8, 16), F32), S((9, 4), F32), GS), ValueError, ["`rhs`", "M=8"]),
    ((S((8, 16), F32), S((8,), F32), GS), ValueError, ["`rhs`", "rank 2"]),
    ((S((8, 16), F32), S((8, 4), F32), S((4,), F32)), TypeError, ["`group_sizes`"]),
])
def test_tgmm_errors_name_the_argument(args, exc, words):
  with pytest.raises(exc) as e:
    _tgmm_bind(*args)
  for w in words:
    assert w in str(e.value)


def test_group_sizes_as_a_list_and_unknown_implementation():
  lhs, rhs = jnp.ones((6, 4)), jnp.ones((2, 4, 3))
  out = gmm(lhs, rhs, [2, 3], implementation="reference")
  assert out.shape == (6, 3) and float(out[5].sum()) == 0
  assert tgmm(lhs, jnp.ones((6, 3)), [2, 3], implementation="xla").shape == (2, 4, 3)
  with pytest.raises(ValueError, match="valid"):
    gmm(lhs, rhs, [2, 3], implementation="nope")
