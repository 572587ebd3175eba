"""Pallas Mosaic TPU gmm: Config, per-generation heuristics, VMEM budget, VJP wiring.

The kernel is in `pallas_mosaic_tpu_kernel.py`. Tiling logic, for
lhs [M, K] @ rhs[g] [K, N]:
- rhs traffic: a step reloads its rhs block only when the block index changes,
  so with the whole [K, N] of a group in one block (tk = K, tn = N) each
  group's weights are read once. That is the first choice whenever it fits.
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

import dataclasses
import itertools
from typing import ClassVar

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops.gmm import base
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu_kernel as kernel


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Requested block sizes; clamped to legal ones per shape/dtype (`kernel.gmm_tiles`)."""

  tm: pydantic.PositiveInt = 256
  tk: pydantic.PositiveInt = 2048
  tn: pydantic.PositiveInt = 1024


_TM_CHOICES = (128, 256, 512, 1024)
_TKN_CHOICES = (4096, 2048, 1024, 512, 256, 128)


def vmem_budget() -> int:
  return gdn_config.target_generation().vmem_bytes // 2


def vmem_limit(estimate: int) -> int:
  """The scoped-VMEM limit passed to Mosaic: estimate plus slack, within the chip."""
  cap = gdn_config.target_generation().vmem_bytes * 3 // 4
  return int(min(cap, max(32 << 20, estimate * 3 // 2 + (8 << 20))))


def interpret_or_raise(name: str) -> bool:
  """False on a TPU (real or AOT target); True in interpret mode; else NotImplementedError."""
  if gdn_config.on_tpu():
    return False
  if gdn_config.interpret_enabled():
    return True
  raise NotImplementedError(
      f"{name} needs a TPU (or interpret mode: TOKAMAX_GDN_INTERPRET=1 /"
      " tokamax_gdn.config.set_interpret(True))."
  )


def _sizes(full: int) -> list[int]:
  """Candidate block sizes along an axis: the full axis, then powers of two below it."""
  return [full] + [c for c in _TKN_CHOICES if c < full]


def parallel_sizes(full: int) -> list[int]:
  """`_sizes` for the kernel's "parallel" grid axis.

  On a megacore chip (v5p: two TensorCores behind one device) that axis is
  what the cores split, so the whole axis in one block would idle a core:
  start from half of it there.
  """
  sizes = _sizes(full)
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
  return kernel.vmem_bytes(tiles, lhs_dtype, rhs_dtype, out_dtype)


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuGmm(base.Gmm[Config, None]):
  """Megablox-style grouped matmul with per-operand dtype tiling."""

  config_cls: ClassVar[type[Config]] = Config

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", base.gmm_vjp_fn("pallas_mosaic_tpu"))

  def _gmm(self, lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, config):
    interpret = interpret_or_raise(type(self).__name__)
    if not jnp.issubdtype(out_dtype, jnp.floating):
      raise NotImplementedError(f"{type(self).__name__}: integer outputs are not supported.")
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    tiles = kernel.gmm_tiles(m, k, n, lhs.dtype, rhs.dtype, out_dtype,
                             tm=config.tm, tk=config.tk, tn=config.tn,
                             transpose_rhs=transpose_rhs)
    estimate = kernel.vmem_bytes(tiles, lhs.dtype, rhs.dtype, out_dtype)
    return kernel.gmm(
        lhs, rhs, group_sizes.astype(jnp.int32),
        tiles=tiles, out_dtype=out_dtype, transpose_rhs=transpose_rhs,
        interpret=interpret, vmem_limit_bytes=None if interpret else vmem_limit(estimate),
    )

  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    m, k, n, ld, rd, od, tr = _gmm_dims(ba)
    budget = vmem_budget()
    ns = parallel_sizes(n)
    for tk, tn in itertools.chain(
        ((k, tn) for tn in ns), ((tk, tn) for tk in _sizes(k)[1:] for tn in ns)):
      cfg = Config(tm=256, tk=tk, tn=tn)
      if gmm_vmem(m, k, n, ld, rd, od, tr, cfg) <= budget:
        return cfg
    return Config(tm=128, tk=128, tn=128)

  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    m, k, n, ld, rd, od, tr = _gmm_dims(ba)
    budget = vmem_budget()
    configs = {
        Config(tm=tm, tk=tk, tn=tn)
        for tm, tk, tn in itertools.product(_TM_CHOICES, _sizes(k), _sizes(n))
    }
    configs.add(self._get_heuristics_config(ba))
    return {c for c in configs if gmm_vmem(m, k, n, ld, rd, od, tr, c) <= budget}

  def supported_on(self, device: jax.Device) -> bool:
    return gdn_config.pallas_tpu_supported(device)


IMPLEMENTATION = PallasMosaicTpuGmm()
