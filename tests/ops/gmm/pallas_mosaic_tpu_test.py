"""The pallas_mosaic_tpu gmm in Pallas TPU interpret mode (CPU), plus its tiling logic.

Lowering for real chips is covered by `aot_test.py`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokamax

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu as pallas
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu_kernel as kernel
from tokamax_gdn.ops.gmm.api import gmm

from .cases import BF16, CASES, F32, I8, SMALL, Case, check_forward, check_vjp, expected, inputs
from .cases import check_heuristic_in_fitting_space

IMPL = "pallas_mosaic_tpu"


@pytest.fixture(autouse=True)
def _interpret():
  with config.interpret_mode(True):
    yield


def _with_config(**tiles):
  return registry.get("gmm", IMPL).replace(config=pallas.Config(**tiles))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward(case):
  check_forward(IMPL, case)


# Several row tiles with groups straddling them, a K tail (200 = 128 + 72,
# masked), partial last M and N blocks, and each dtype's sublane tiling.
TILED = [
    (Case("f32_tiled", 70, 200, 130, (0, 33, 20, 0)), dict(tm=8, tk=128, tn=128)),
    (Case("bf16_tiled_transposed", 70, 200, 130, (9, 0, 40, 21), BF16, transpose_rhs=True),
     dict(tm=16, tk=128, tn=128)),
    (Case("int8_x_bf16_tiled", 100, 136, 128, (31, 2, 0, 60), I8, BF16),
     dict(tm=32, tk=128, tn=128)),
]


@pytest.mark.parametrize("case,tiles", TILED, ids=[c.name for c, _ in TILED])
def test_forward_tiled(case, tiles):
  check_forward(_with_config(**tiles), case)


# Whole weights per group (tk = K, tn = N): the weights ride a ring of
# kernel.RING_SLOTS slots fetched ahead by group. More groups than slots,
# empty groups between and at the ends (no copy for them), several groups in
# one row tile and one group over several, rows past sum(group_sizes), one
# non-empty group, none.
WHOLE = [
    Case("ring_f32", 96, 48, 40, (0, 5, 0, 0, 17, 3, 1, 0, 30, 9, 0, 12, 0)),
    Case("ring_bf16_transposed", 80, 64, 136, (7, 0, 2, 2, 2, 40, 0, 11, 0, 0), BF16,
         transpose_rhs=True),
    Case("ring_int8_x_bf16", 64, 128, 128, (1, 1, 1, 1, 1, 1, 1, 1, 50), I8, BF16),
    Case("ring_one_group", 40, 32, 24, (0, 0, 33, 0)),
    Case("ring_all_empty", 40, 32, 24, (0, 0, 0)),
]


@pytest.mark.parametrize("case", WHOLE, ids=str)
def test_forward_whole_groups(case, monkeypatch):
  # The ring at small shapes too (on a TPU it starts at kernel.RING_MIN_BYTES).
  monkeypatch.setattr(kernel, "RING_MIN_BYTES", 0)
  op = _with_config(tm=8 if case.lhs_dtype == F32 else 32, tk=4096, tn=4096)
  tiles = kernel.gmm_tiles(case.m, case.k, case.n, case.lhs_dtype, case.rhs_dtype or
                           case.lhs_dtype, case.lhs_dtype, tm=op.config.tm, tk=4096, tn=4096,
                           transpose_rhs=case.transpose_rhs)
  assert kernel.whole_groups(tiles, case.k, case.n, case.rhs_dtype or case.lhs_dtype)
  check_forward(op, case)


@pytest.mark.parametrize("name", ["f32_zeros_sum_lt_m", "bf16_x_f32", "f32_transposed"])
def test_vjp(name):
  check_vjp(IMPL, SMALL[name])


def test_tokamax_ragged_dot_accepts_the_op():
  lhs, rhs, gs = inputs(SMALL["f32_zeros_sum_lt_m"])
  op = registry.get("gmm", IMPL)
  got = tokamax.ragged_dot(lhs, rhs, gs, implementation=op)
  np.testing.assert_allclose(got, gmm(lhs, rhs, gs, implementation=IMPL), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(got, expected(lhs, rhs, gs, False), rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(tokamax.ragged_dot(lhs, rhs, gs, implementation=[op]), got)
  trans = tokamax.ragged_dot_general(
      lhs, jnp.swapaxes(rhs, 1, 2), gs, implementation=op,
      ragged_dot_dimension_numbers=jax.lax.RaggedDotDimensionNumbers(
          dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
          rhs_group_dimensions=[0]))
  np.testing.assert_allclose(trans, got, rtol=1e-6, atol=1e-6)
  grad = jax.grad(lambda w: jnp.sum(tokamax.ragged_dot(lhs, w, gs, implementation=op) ** 2))(rhs)
  want = jax.grad(lambda w: jnp.sum(expected(lhs, w, gs, False) ** 2))(rhs)
  np.testing.assert_allclose(grad, want, rtol=1e-3, atol=1e-3)


def test_off_tpu_without_interpret_is_not_implemented():
  lhs, rhs, gs = inputs(SMALL["f32_one_group"])
  with config.interpret_mode(False):
    with pytest.raises(NotImplementedError):
      registry.get("gmm", IMPL)(lhs, rhs, gs)
    # The registry falls through to the next implementation.
    out = gmm(lhs, rhs, gs, implementation=[IMPL, "xla"])
  assert out.shape == (lhs.shape[0], rhs.shape[2])


def test_block_sizes_respect_each_operands_own_tiling():
  # M is the sublane axis of lhs and out only: an int8 rhs must not force the
  # 32-row int8 tiling on it (a "common sublane" would), bf16 needs 16.
  t = kernel.gmm_tiles(100, 256, 256, BF16, I8, BF16, tm=48, tk=128, tn=128,
                       transpose_rhs=False)
  assert (t.tm, t.tk, t.tn) == (48, 128, 128)
  assert kernel.gmm_tiles(100, 256, 256, I8, BF16, BF16, tm=48, tk=128, tn=128,
                          transpose_rhs=False).tm == 32
  assert kernel.gmm_tiles(100, 256, 256, F32, F32, F32, tm=40, tk=128, tn=128,
                          transpose_rhs=False).tm == 40
  # A small axis is taken whole (always a legal block), whatever its size.
  assert kernel.gmm_tiles(37, 24, 20, BF16, F32, F32, tm=256, tk=512, tn=512,
                          transpose_rhs=True) == kernel.Tiles(37, 24, 20)
  assert [kernel.sublane_tiling(d) for d in (F32, BF16, I8, jnp.float8_e5m2)] == [8, 16, 32, 32]


@pytest.mark.parametrize("visit_empty_groups", [False, True], ids=["gmm", "tgmm"])
def test_schedule_visits_each_tile_group_pair_once(visit_empty_groups):
  s = kernel.schedule(jnp.asarray([5, 0, 20, 3], jnp.int32), m=40, tm=8,
                      visit_empty_groups=visit_empty_groups)
  mode, tile, group = np.asarray(s.mode), np.asarray(s.tile), np.asarray(s.group)
  assert len(mode) == 5 + 4 - 1
  pairs = [(int(t), int(g)) for t, g, md in zip(tile, group, mode) if md == kernel.COMPUTE]
  assert pairs == [(0, 0), (0, 2), (1, 2), (2, 2), (3, 2), (3, 3)]
  if visit_empty_groups:  # tgmm: the empty group 1 gets its zero output block
    assert group[mode == kernel.ZERO].tolist() == [1]
  else:  # gmm: the row tile past the 28 grouped rows is zeroed
    assert tile[mode == kernel.ZERO].tolist() == [4]
  assert (mode == kernel.IDLE).sum() == 1 and group[-1] == 3
  # Outside COMPUTE steps the input blocks stay put (no DMA).
  in_tile = np.asarray(s.in_tile)
  assert in_tile[mode != kernel.COMPUTE].tolist() == ([0, 3] if visit_empty_groups else [3, 3])


QWEN = [(8192, 2048, 1024, 8), (8192, 2048, 512, 128), (8192, 512, 2048, 128)]
DTYPES = [(BF16, BF16), (BF16, F32), (F32, BF16), (I8, BF16)]


def test_heuristics_fit_vmem_and_are_in_the_autotuning_space(target_chip):
  op = registry.get("gmm", IMPL)
  for m, k, n, g in QWEN:
    for ld, rd in DTYPES:
      for transpose in (False, True):
        rshape = (g, n, k) if transpose else (g, k, n)
        ba = op.bind(jax.ShapeDtypeStruct((m, k), ld), jax.ShapeDtypeStruct(rshape, rd),
                     jax.ShapeDtypeStruct((g,), jnp.int32), transpose_rhs=transpose)
        od = ba.kwargs["preferred_element_type"]
        check_heuristic_in_fitting_space(
            op, ba, functools.partial(pallas.gmm_vmem, m, k, n, ld, rd, od, transpose))
  ba = op.bind(jax.ShapeDtypeStruct((8192, 2048), BF16),
               jax.ShapeDtypeStruct((8, 2048, 1024), BF16),
               jax.ShapeDtypeStruct((8,), jnp.int32))
  # Whole [K, N] weight of a group per block: each expert's weights read once
  # (half of N on v5p, whose two cores split the n axis).
  want_tn = 512 if target_chip == "v5p" else 1024
  assert ba.heuristics_config == pallas.Config(tm=256, tk=2048, tn=want_tn)


def test_ring_only_for_blocks_of_a_mib_or_more():
  """The hand-copied ring where a group's block is MiBs (MoE shapes); small
  blocks stay pipelined operands (the ring's small operand crashed libtpu's
  compiler on the v5e chip at the int8 x bf16 conformance spec)."""
  def ring(m, k, n, dtype):
    tiles = kernel.gmm_tiles(m, k, n, dtype, dtype, dtype, tm=128, tk=4096, tn=4096,
                             transpose_rhs=False)
    return kernel.whole_groups(tiles, k, n, dtype)
  assert ring(16384, 2048, 512, jnp.bfloat16) and ring(16384, 512, 2048, jnp.bfloat16)
  assert not ring(64, 32, 48, jnp.bfloat16)
  assert not ring(1024, 512, 512, jnp.bfloat16)      # 512 KiB
  assert ring(1024, 512, 512, jnp.float32)           # 1 MiB
