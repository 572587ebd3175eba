"""Pallas Mosaic TPU tgmm: Config, per-generation heuristics, VMEM budget, VJP wiring.

The kernel is `tgmm` in `tokamax_gdn/ops/gmm/pallas_mosaic_tpu_kernel.py`, next
to gmm's (one schedule for both, as in megablox); Config and tiling helpers
are gmm's wrapper's. For out[g] = lhs[rows_g]^T @
rhs[rows_g] with lhs [M, K], rhs [M, N], out [G, K, N]: lhs is read once per
n tile and rhs once per k tile, so the first choice is the whole [K, N]
output of a group in one block (a float32 accumulator of K*N*4 bytes), then
smaller tn, then smaller tk, until the VMEM estimate fits half the chip's
VMEM. tm (the contraction per step) is 128 where the MXU is 128 wide (v5e,
v5p) and 256 on the 256-wide ones: each group boundary inside a tile costs
one extra step; on a v5e chip at MoE shapes (M=16384, 64 groups) 128 was
the faster (CHANGELOG.md, 2026-12-06), and on v6e's static estimate for the
Qwen3.5 shape (8192x2048x1024, G=8) 256 beats 512 and 128.
"""

import dataclasses
from typing import ClassVar

from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu as gmm_pallas
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu_kernel as kernel
from tokamax_gdn.ops.tgmm import base

Config = gmm_pallas.Config


def _dims(ba: op.BoundArguments):
  lhs, rhs = ba.args
  return (lhs.shape[0], lhs.shape[1], rhs.shape[1], lhs.dtype, rhs.dtype,
          ba.kwargs["preferred_element_type"])


def tgmm_vmem(m, k, n, lhs_dtype, rhs_dtype, out_dtype, cfg: Config) -> int:
  tiles = kernel.tgmm_tiles(m, k, n, lhs_dtype, rhs_dtype, out_dtype,
                            tm=cfg.tm, tk=cfg.tk, tn=cfg.tn)
  return kernel.vmem_bytes(tiles, lhs_dtype, rhs_dtype, out_dtype, transposed=True,
                           ring=kernel.whole_groups(tiles, k, n, out_dtype))


def _tiling(ba: op.BoundArguments) -> gmm_pallas.Tiling:
  m, k, n, ld, rd, od = _dims(ba)
  # k is the first "parallel" axis: on v5p it is split across the two cores.
  return gmm_pallas.Tiling(k, n, parallel_k=True,
                           vmem=lambda cfg: tgmm_vmem(m, k, n, ld, rd, od, cfg),
                           tm=gdn_config.target_generation().mxu)


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuTgmm(gmm_pallas.PallasGroupedMatmul, base.Tgmm[Config, None]):
  """Megablox-style transposed grouped matmul with per-operand dtype tiling."""

  op_name: ClassVar[str] = "tgmm"
  tiling = _tiling

  def _tgmm(self, lhs, rhs, group_sizes, *, out_dtype, config):
    interpret = self._check_supported(out_dtype)
    m, k = lhs.shape
    n = rhs.shape[1]
    tiles = kernel.tgmm_tiles(m, k, n, lhs.dtype, rhs.dtype, out_dtype,
                              tm=config.tm, tk=config.tk, tn=config.tn)
    estimate = kernel.vmem_bytes(tiles, lhs.dtype, rhs.dtype, out_dtype, transposed=True,
                                 ring=kernel.whole_groups(tiles, k, n, out_dtype))
    return kernel.tgmm(
        lhs, rhs, group_sizes,
        tiles=tiles, out_dtype=out_dtype, interpret=interpret,
        vmem_limit_bytes=None if interpret else gmm_pallas.vmem_limit(estimate),
    )


IMPLEMENTATION = PallasMosaicTpuTgmm()
