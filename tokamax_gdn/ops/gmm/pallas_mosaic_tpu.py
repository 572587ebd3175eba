"""Pallas Mosaic TPU gmm: Config, per-generation heuristics, VMEM budget, VJP wiring.

The kernel is in `pallas_mosaic_tpu_kernel.py` (with tgmm's: one schedule for
both); the Config and tiling helpers here serve tgmm's wrapper too. Tiling logic, for
lhs [M, K] @ rhs[g] [K, N]:
- rhs traffic: a step reloads its rhs block only when the block index changes,
  so with the whole [K, N] of a group in one block (tk = K, tn = N) each
  group's weights are read once. That is the first choice whenever it fits;
  the kernel then fetches each group's weights by hand, RING_SLOTS - 1 groups
  ahead (`kernel.whole_groups`), as the grid pipeline's one step ahead left a
  stall at every group change.
- lhs traffic: lhs is read once per n tile, so tn = N reads it once.
- tm: every group boundary inside a row tile costs one more full-tile step
  (tiles_m + G - 1 steps at most), so smaller tm wastes less at boundaries;
  256 keeps the MXU busy (256 rows fill v6e/tpu7x's 256-wide MXU and two
  passes of v5e's 128-wide one) with per-step work well above the ~0.35 us
  step overhead at Qwen3.5-MoE sizes.
Configs whose VMEM estimate exceeds half the chip's VMEM are dropped (the
other half is headroom for Mosaic's internal scratch and the compiler's own
estimate, which is larger than ours).
"""

from collections.abc import Callable
import dataclasses
import itertools
from typing import ClassVar

import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops.gmm import base
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu_kernel as kernel


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Requested block sizes; clamped to legal ones per shape/dtype (`kernel.gmm_tiles`)."""

  tm: pydantic.PositiveInt = 256
  tk: pydantic.PositiveInt = 2048
  tn: pydantic.PositiveInt = 1024


TM_CHOICES = (128, 256, 512, 1024)
_TKN_CHOICES = (4096, 2048, 1024, 512, 256, 128)


def vmem_budget() -> int:
  """The VMEM a config's estimate may take: half the chip's (see module docstring)."""
  return gdn_config.target_generation().vmem_bytes // 2


def vmem_limit(estimate: int) -> int:
  """The scoped-VMEM limit passed to Mosaic: estimate plus slack, within the chip."""
  cap = gdn_config.target_generation().vmem_bytes * 3 // 4
  return int(min(cap, max(32 << 20, estimate * 3 // 2 + (8 << 20))))


def block_sizes(full: int) -> list[int]:
  """Candidate block sizes along an axis: the full axis, then powers of two below it
  (an empty axis, which no kernel runs on, gets 1: a Config's sizes are positive)."""
  return [max(full, 1)] + [c for c in _TKN_CHOICES if c < full]


def parallel_sizes(full: int) -> list[int]:
  """`block_sizes` for the kernel's "parallel" grid axis.

  On a megacore chip (v5p: two TensorCores behind one device) that axis is
  what the cores split, so the whole axis in one block would idle a core:
  start from half of it there.
  """
  sizes = block_sizes(full)
  if gdn_config.target_generation().name == "v5p":
    halves = [c for c in sizes if c <= full // 2 and c % 128 == 0]
    return halves or sizes
  return sizes


def _gmm_dims(ba: op.BoundArguments):
  lhs, rhs = ba.args
  transpose_rhs = ba.kwargs["transpose_rhs"]
  m, k = lhs.shape
  n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  return m, k, n, lhs.dtype, rhs.dtype, ba.kwargs["preferred_element_type"], transpose_rhs


def gmm_vmem(m, k, n, lhs_dtype, rhs_dtype, out_dtype, transpose_rhs, cfg: Config) -> int:
  tiles = kernel.gmm_tiles(m, k, n, lhs_dtype, rhs_dtype, out_dtype,
                           tm=cfg.tm, tk=cfg.tk, tn=cfg.tn, transpose_rhs=transpose_rhs)
  return kernel.vmem_bytes(tiles, lhs_dtype, rhs_dtype, out_dtype, transposed=False,
                           ring=kernel.whole_groups(tiles, k, n, rhs_dtype))


@dataclasses.dataclass(frozen=True)
class Tiling:
  """One gmm or tgmm call's tiling problem, which both choose a Config for alike.

  k, n: the output's contraction-side and column sizes to tile (tk, tn).
  parallel_k: whether the kernel's "parallel" grid axis is K's (tgmm) or N's
    (gmm); on a megacore chip that axis starts from half (`parallel_sizes`).
  vmem: a Config's VMEM estimate for this call.
  tm: the heuristic's row tile.
  """

  k: int
  n: int
  parallel_k: bool
  vmem: Callable[[Config], int]
  tm: int = 256

  def fits(self, cfg: Config) -> bool:
    return self.vmem(cfg) <= vmem_budget()

  def heuristic(self) -> Config:
    """`tm` and the first (tk, tn), largest first, that fits; else the smallest tiles."""
    tks = parallel_sizes(self.k) if self.parallel_k else block_sizes(self.k)
    tns = block_sizes(self.n) if self.parallel_k else parallel_sizes(self.n)
    for tk, tn in itertools.product(tks, tns):
      cfg = Config(tm=self.tm, tk=tk, tn=tn)
      if self.fits(cfg):
        return cfg
    return Config(tm=128, tk=128, tn=128)

  def autotuning_configs(self) -> set[Config]:
    """`TM_CHOICES` x `block_sizes` of K and N, and the heuristic choice, that fit."""
    configs = {
        Config(tm=tm, tk=tk, tn=tn)
        for tm, tk, tn in itertools.product(TM_CHOICES, block_sizes(self.k), block_sizes(self.n))
    }
    configs.add(self.heuristic())
    return {c for c in configs if self.fits(c)}


class PallasGroupedMatmul(config_hooks.PallasTpuHooks):
  """What the Pallas gmm and tgmm Ops share (mixin, before the Op base): the
  Config, chosen from the call's `Tiling` (`tiling(ba)`, each module's), the
  VJP family, and where the kernels run (`_check_supported`)."""

  config_cls: ClassVar[type[Config]] = Config
  vjp_family: ClassVar[str] = "pallas_mosaic_tpu"
  tiling: ClassVar[Callable[[op.BoundArguments], Tiling]]

  @classmethod
  def heuristics(cls, ba: op.BoundArguments) -> Config:
    return cls.tiling(ba).heuristic()

  @classmethod
  def autotuning_configs(cls, ba: op.BoundArguments) -> set[Config]:
    return cls.tiling(ba).autotuning_configs()

  def _check_supported(self, out_dtype) -> bool:
    """Returns interpret mode; raises NotImplementedError where the kernel can't run."""
    interpret = gdn_config.require_pallas_tpu(self.op_name)
    if not jnp.issubdtype(out_dtype, jnp.floating):
      raise NotImplementedError(f"{type(self).__name__}: integer outputs are not supported.")
    return interpret


def _tiling(ba: op.BoundArguments) -> Tiling:
  m, k, n, ld, rd, od, tr = _gmm_dims(ba)
  return Tiling(k, n, parallel_k=False,
                vmem=lambda cfg: gmm_vmem(m, k, n, ld, rd, od, tr, cfg))


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuGmm(PallasGroupedMatmul, base.Gmm[Config, None]):
  """Megablox-style grouped matmul with per-operand dtype tiling."""

  op_name: ClassVar[str] = "gmm"
  tiling = _tiling

  def _gmm(self, lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, config):
    interpret = self._check_supported(out_dtype)
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiles = kernel.gmm_tiles(m, k, n, lhs.dtype, rhs.dtype, out_dtype,
                             tm=config.tm, tk=config.tk, tn=config.tn,
                             transpose_rhs=transpose_rhs)
    estimate = kernel.vmem_bytes(tiles, lhs.dtype, rhs.dtype, out_dtype, transposed=False,
                                 ring=kernel.whole_groups(tiles, k, n, rhs.dtype))
    return kernel.gmm(
        lhs, rhs, group_sizes,
        tiles=tiles, out_dtype=out_dtype, transpose_rhs=transpose_rhs,
        interpret=interpret, vmem_limit_bytes=None if interpret else vmem_limit(estimate),
    )


IMPLEMENTATION = PallasMosaicTpuGmm()
