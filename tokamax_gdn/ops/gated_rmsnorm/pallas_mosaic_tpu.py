"""Pallas Mosaic TPU gated RMSNorm: Op wrapper (config, heuristics, VJP).

The kernels (`pallas_mosaic_tpu_kernel.py`) run over blocks of rows with a
row's D elements whole in VMEM and its groups of V as lane-aligned slices.
Where V is neither a multiple of 128 nor all of D (small heads), the rows
are viewed as [rows · D / V, V] first (a relayout in XLA; such layers are
small). The op is memory-bound (a few dozen flops per element), so a block
only needs to be large enough to amortise the grid step. Rows are
independent: under `jax.jit` with inputs sharded by batch the kernels run
per shard (`ops.partitioning`).
"""

import dataclasses
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops import partitioning
from tokamax_gdn.ops.gated_rmsnorm import base
from tokamax_gdn.ops.gated_rmsnorm import pallas_mosaic_tpu_kernel as kernel
from tokamax_gdn.ops.tiling import round_up  # pylint: disable=g-importing-member

_MIB = 1 << 20
_LANES = 128
_SUBLANES = 16          # bf16's native tiling (f32's 8 divides it)
# Elements of a row block the heuristic aims at (1 MiB of bf16 per operand).
_BLOCK_ELEMENTS = 1 << 19


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """block_rows: rows per block (all N rows when there are fewer)."""

  block_rows: Annotated[int, pydantic.Field(gt=0, multiple_of=_SUBLANES)] = 1024


def _aligned(d: int, v: int) -> bool:
  """Whether the kernels take the groups of V as slices of a row of D."""
  return v == d or v % _LANES == 0


def _rows_of(ba: op.BoundArguments) -> tuple[int, int]:
  """(N, D) of the kernels' [B, N, D] view (`base.rows`, then `_kernel_rows`)."""
  _, n, d = base.rows_shape(tuple(ba.arguments["x"].shape))
  v = ba.arguments["weight"].shape[0]
  return (n, d) if _aligned(d, v) else (n * d // v, v)


def _kernel_rows(x: jax.Array, v: int) -> jax.Array:
  """x [B, N, D] as the kernels take it: as it is, or [B, N·D/V, V]."""
  b, n, d = x.shape
  return x if _aligned(d, v) else x.reshape(b, n * d // v, v)


def _heuristics(ba: op.BoundArguments) -> Config:
  """About `_BLOCK_ELEMENTS` elements a block, 16 to 4096 rows."""
  n, d = _rows_of(ba)
  rows = min(4096, max(_SUBLANES, _BLOCK_ELEMENTS // max(d, 1) // _SUBLANES * _SUBLANES))
  return Config(block_rows=min(rows, round_up(max(n, 1), _SUBLANES)))


def _autotuning_configs(ba: op.BoundArguments) -> set[Config]:
  n, _ = _rows_of(ba)
  space = {Config(block_rows=r) for r in (64, 128, 256, 512, 1024, 2048, 4096)
           if r <= round_up(max(n, 1), _SUBLANES)}
  return space | {_heuristics(ba)}


def _block_rows(config: Config, n: int) -> int:
  """The kernels' block: the config's, or all N rows (a full dimension needs
  no tiling) when there are no more."""
  return n if n <= config.block_rows else config.block_rows


def _vmem_limit(block_rows: int, d: int, v: int, itemsize: int) -> int:
  """The backward (the larger kernel): 4 row blocks in and 2 out, double
  buffered, and about 10 float32 temporaries of a block's group."""
  est = 2 * 6 * block_rows * d * itemsize + 10 * block_rows * v * 4 + 4 * v * 4
  cap = gdn_config.target_generation().vmem_bytes * 3 // 4
  return int(min(cap, max(32 * _MIB, 2 * est)))


def _check_supported(x: jax.Array) -> bool:
  """Returns interpret mode; raises NotImplementedError where the kernels can't run."""
  interpret = gdn_config.require_pallas_tpu("gated_rmsnorm")
  if x.dtype not in (jnp.float32, jnp.bfloat16):
    raise NotImplementedError(f"pallas_mosaic_tpu supports float32/bfloat16 x; got {x.dtype}.")
  return interpret


# Dimension labels for `ops.partitioning`: batch rows are independent.
_LABELS = dict(x="b n d", gate="b n d", dy="b n d", weight="v")


def _kernel_kwargs(config: Config, x: jax.Array, v: int, eps: float, interpret: bool) -> dict:
  """Keywords of the kernels on x [B, N, D] (the kernels' view)."""
  n, d = x.shape[1:]
  rows = _block_rows(config, n)
  return dict(eps=eps, block_rows=rows, interpret=interpret,
              vmem_limit_bytes=_vmem_limit(rows, d, v, x.dtype.itemsize))


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuGatedRmsNormVjp(config_hooks.PallasTpuHooks,
                                      base.GatedRmsNormVjp[Config, None]):
  """The backward kernel: dx, dgate and each batch row's dweight part."""

  op_name: ClassVar[str] = "gated_rmsnorm"
  config_cls: ClassVar[type[Config]] = Config
  heuristics = _heuristics
  autotuning_configs = _autotuning_configs

  def _norm_bwd(self, x, gate, weight, dy, *, eps, config: Config):
    interpret = _check_supported(x)

    def body(x, gate, weight, dy):
      v = weight.shape[0]
      x_k, gate_k, dy_k = (_kernel_rows(a, v) for a in (x, gate, dy.astype(x.dtype)))
      dx, dgate, dw = kernel.gated_rmsnorm_bwd(
          x_k, gate_k, weight, dy_k, **_kernel_kwargs(config, x_k, v, eps, interpret))
      return dx.reshape(x.shape), dgate.reshape(gate.shape), dw

    dx, dgate, dw_rows = partitioning.call_per_shard(
        body, dict(x=x, gate=gate, weight=weight, dy=dy), _LABELS,
        ["b n d", "b n d", "b v"], key_heads=1)
    return dx, dgate, jnp.sum(dw_rows, axis=0)


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuGatedRmsNorm(config_hooks.PallasTpuHooks, base.GatedRmsNorm[Config, None]):
  """Row-blocked gated RMSNorm in Pallas Mosaic TPU (forward + backward kernels)."""

  op_name: ClassVar[str] = "gated_rmsnorm"
  config_cls: ClassVar[type[Config]] = Config
  heuristics = _heuristics
  autotuning_configs = _autotuning_configs

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", PallasMosaicTpuGatedRmsNormVjp())

  def _norm(self, x, gate, weight, *, eps, config: Config):
    interpret = _check_supported(x)

    def body(x, gate, weight):
      v = weight.shape[0]
      x_k, gate_k = _kernel_rows(x, v), _kernel_rows(gate, v)
      y = kernel.gated_rmsnorm_fwd(x_k, gate_k, weight,
                                   **_kernel_kwargs(config, x_k, v, eps, interpret))
      return (y.reshape(x.shape),)

    (y,) = partitioning.call_per_shard(body, dict(x=x, gate=gate, weight=weight), _LABELS,
                                       ["b n d"], key_heads=1)
    return y


IMPLEMENTATION = PallasMosaicTpuGatedRmsNorm()
