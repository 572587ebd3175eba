"""gmm / tgmm base (shared by every implementation): errors name the argument, empty
shapes give zeros, group offsets are summed in int32 whatever the sizes' dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.gmm import base
from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.tgmm.api import tgmm

S = jax.ShapeDtypeStruct
F32, BF16 = jnp.float32, jnp.bfloat16


def _gmm_bind(lhs, rhs, gs, **kw):
  return registry.get("gmm", "reference").bind(lhs, rhs, gs, **kw)


def _tgmm_bind(lhs, rhs, gs, **kw):
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


# Every implementation goes through the shared base: empty shapes and the
# dtype of group_sizes are handled there once.
_IMPLS = [pytest.param(op, impl, id=f"{op}-{impl}")
          for op in ("gmm", "tgmm") for impl in ("reference", "xla", "pallas_mosaic_tpu")]


@pytest.fixture
def interpret():
  with config.interpret_mode(True):  # Pallas interpret mode off TPU, through the VJP too
    yield


def _call(op_name, impl, lhs, rhs, gs):
  return registry.get(op_name, impl)(lhs, rhs, gs)


@pytest.mark.parametrize("op_name,impl", _IMPLS)
@pytest.mark.parametrize("m,k,n,g", [(0, 16, 8, 3), (12, 0, 8, 3), (12, 16, 0, 3), (12, 16, 8, 0)],
                         ids=["M0", "K0", "N0", "G0"])
def test_empty_shapes_give_zeros_of_the_right_shape(interpret, op_name, impl, m, k, n, g):
  del interpret
  key = jax.random.key(0)
  lhs = jax.random.normal(key, (m, k), F32)
  rhs = jax.random.normal(key, (g, k, n) if op_name == "gmm" else (m, n), F32)
  gs = jnp.zeros((g,), jnp.int32).at[:1].set(m) if g else jnp.zeros((0,), jnp.int32)
  out = _call(op_name, impl, lhs, rhs, gs)
  assert out.shape == ((m, n) if op_name == "gmm" else (g, k, n))
  assert not jnp.any(out)
  loss = lambda a, b: jnp.sum(_call(op_name, impl, a, b, gs))
  dlhs, drhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs)
  assert dlhs.shape == lhs.shape and drhs.shape == rhs.shape


INT_DTYPES = [jnp.int8, jnp.uint8, jnp.int16, jnp.uint16, jnp.int32, jnp.uint32, jnp.int64]


def _overflow_case(op_name):
  """Sizes of 100 fit every integer dtype; their running sums (200, 260) do
  not fit int8. (lhs, rhs, sizes, want): want from a float64 numpy product
  per group."""
  sizes = np.array([100, 100, 60], np.int64)
  m, k, n = 300, 8, 8
  rng = np.random.default_rng(0)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rows = np.split(np.arange(sizes.sum()), np.cumsum(sizes)[:-1])
  if op_name == "gmm":
    rhs = rng.standard_normal((3, k, n)).astype(np.float32)
    want = np.zeros((m, n))
    for g, r in enumerate(rows):
      want[r] = lhs[r].astype(np.float64) @ rhs[g]
  else:
    rhs = rng.standard_normal((m, n)).astype(np.float32)
    want = np.stack([lhs[r].T.astype(np.float64) @ rhs[r] for r in rows])
  return jnp.asarray(lhs), jnp.asarray(rhs), sizes, want


@pytest.mark.parametrize("op_name", ["gmm", "tgmm"])
def test_group_sizes_of_every_integer_dtype_are_summed_in_int32(op_name):
  """The shared base hands every implementation int32 sizes (checked here on
  the reference, whose per-group loop sums the offsets itself)."""
  lhs, rhs, sizes, want = _overflow_case(op_name)
  for dtype in INT_DTYPES:
    gs = jnp.asarray(sizes).astype(dtype)
    ba = registry.get(op_name, "reference").bind(lhs, rhs, gs)
    assert ba.kwargs["group_sizes"].dtype == jnp.int32, dtype
    out = _call(op_name, "reference", lhs, rhs, gs)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4, err_msg=str(dtype))


@pytest.mark.parametrize("op_name,impl", _IMPLS)
def test_int8_group_offsets_do_not_overflow(interpret, op_name, impl):
  """int8 sizes (the dtype whose running sum overflows) through every
  implementation, against a float64 numpy product per group."""
  del interpret
  lhs, rhs, sizes, want = _overflow_case(op_name)
  out = _call(op_name, impl, lhs, rhs, jnp.asarray(sizes).astype(jnp.int8))
  np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
