"""The pallas_mosaic_tpu tgmm in Pallas TPU interpret mode (CPU), plus its tiling logic."""

import functools

import jax
import jax.numpy as jnp
import pytest

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu_kernel as kernel
from tokamax_gdn.ops.tgmm import pallas_mosaic_tpu as pallas

from ..gmm.cases import check_heuristic_in_fitting_space
from .cases import BF16, CASES, F32, I8, SMALL, Case, check_forward, check_vjp

IMPL = "pallas_mosaic_tpu"


@pytest.fixture(autouse=True)
def _interpret():
  with config.interpret_mode(True):
    yield


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward(case):
  # inf/NaN rows past sum(group_sizes) must not reach the output.
  check_forward(IMPL, case, garbage_tail=True)


TILED = [
    (Case("f32_tiled", 70, 200, 130, (0, 33, 20, 0)), dict(tm=8, tk=128, tn=128)),
    (Case("bf16_tiled", 70, 136, 200, (9, 0, 40, 17), BF16), dict(tm=16, tk=128, tn=128)),
    (Case("int8_x_bf16_tiled", 100, 136, 128, (31, 2, 0, 60), I8, BF16),
     dict(tm=32, tk=128, tn=128)),
]


@pytest.mark.parametrize("case,tiles", TILED, ids=[c.name for c, _ in TILED])
def test_forward_tiled(case, tiles):
  op = registry.get("tgmm", IMPL).replace(config=pallas.Config(**tiles))
  check_forward(op, case)


# Whole groups (tk = K, tn = N): each group's output leaves through a ring of
# kernel.RING_SLOTS VMEM slots. More groups than slots, empty groups (zeros
# written through the ring) at the start, between and at the end, several
# groups in one row tile and one group over several, garbage rows past
# sum(group_sizes), every group empty.
WHOLE = [
    Case("ring_f32", 96, 48, 40, (0, 5, 0, 0, 17, 3, 1, 0, 30, 9, 0, 12, 0)),
    Case("ring_bf16", 80, 64, 136, (7, 0, 2, 2, 2, 40, 0, 11, 0, 0), BF16),
    Case("ring_int8_x_bf16", 64, 128, 128, (1, 1, 1, 1, 1, 1, 1, 1, 50), I8, BF16),
    Case("ring_two_groups", 40, 32, 24, (0, 33)),
    Case("ring_all_empty", 40, 32, 24, (0, 0, 0, 0, 0)),
]


@pytest.mark.parametrize("case", WHOLE, ids=str)
def test_forward_whole_groups(case, monkeypatch):
  # The ring at small shapes too (on a TPU it starts at kernel.RING_MIN_BYTES).
  monkeypatch.setattr(kernel, "RING_MIN_BYTES", 0)
  tm = 8 if case.lhs_dtype == F32 else 32
  op = registry.get("tgmm", IMPL).replace(config=pallas.Config(tm=tm, tk=4096, tn=4096))
  rhs_dtype = case.rhs_dtype or case.lhs_dtype
  tiles = kernel.tgmm_tiles(case.m, case.k, case.n, case.lhs_dtype, rhs_dtype, F32, tm=tm,
                            tk=4096, tn=4096)
  assert kernel.whole_groups(tiles, case.k, case.n, F32)
  check_forward(op, case)


@pytest.mark.parametrize("name", ["f32_zeros_sum_lt_m", "bf16_x_f32"])
def test_vjp(name):
  check_vjp(IMPL, SMALL[name])


def test_block_sizes_respect_each_operands_own_tiling():
  # M is the sublane axis of both inputs: bf16 lhs with f32 rhs needs 16 rows,
  # not the 32 of int8, nor an f32 8 that would break the bf16 operand.
  assert kernel.tgmm_tiles(100, 256, 256, BF16, F32, F32, tm=40, tk=128, tn=128).tm == 32
  assert kernel.tgmm_tiles(100, 256, 256, F32, F32, F32, tm=40, tk=128, tn=128).tm == 40
  assert kernel.tgmm_tiles(100, 256, 256, I8, BF16, BF16, tm=48, tk=128, tn=128).tm == 32


@pytest.mark.usefixtures("target_chip")   # each TPU generation in turn
def test_heuristics_fit_vmem_and_are_in_the_autotuning_space():
  op = registry.get("tgmm", IMPL)
  for m, k, n, g in [(8192, 2048, 1024, 8), (8192, 2048, 512, 128), (8192, 512, 2048, 128)]:
    for ld, rd in [(BF16, BF16), (BF16, F32), (I8, BF16)]:
      ba = op.bind(jax.ShapeDtypeStruct((m, k), ld), jax.ShapeDtypeStruct((m, n), rd),
                   jax.ShapeDtypeStruct((g,), jnp.int32))
      od = ba.kwargs["preferred_element_type"]
      check_heuristic_in_fitting_space(
          op, ba, functools.partial(pallas.tgmm_vmem, m, k, n, ld, rd, od))


@pytest.mark.parametrize("chip,tm", [("v5e", 128), ("v5p", 128), ("v6e", 256), ("tpu7x", 256)])
def test_heuristic_row_tile_follows_the_mxu_width(chip, tm):
  # 128 rows a step filled v5e's 128-wide MXU faster than 256 on the chip.
  config.set_target_chip(chip)
  try:
    ba = registry.get("tgmm", IMPL).bind(
        jax.ShapeDtypeStruct((16384, 2048), BF16), jax.ShapeDtypeStruct((16384, 512), BF16),
        jax.ShapeDtypeStruct((64,), jnp.int32))
    assert ba.heuristics_config.tm == tm
  finally:
    config.set_target_chip(None)
