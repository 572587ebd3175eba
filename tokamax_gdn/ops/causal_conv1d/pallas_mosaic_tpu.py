"""Pallas Mosaic TPU causal conv1d: Op wrapper (config, heuristics, VMEM, VJP).

The kernels (forward with fused SiLU; backward giving dx and per-tile dweight /
dbias partials) live in `pallas_mosaic_tpu_kernel.py` with their math. This
wrapper pads T and D to whole tiles, builds the 8-row halos each tile needs
(from x and the initial state), and finishes in XLA what touches only W-1
tokens: the final state (base.py) and the initial-state gradient.

The op is memory-bound (2·W flops per input element): tiles only need to be
big enough to amortise the per-step overhead and the halo (8 / block_t extra
reads); residuals are none (the backward recomputes the pre-activation).

On libtpu's static estimate the VPU (shifts, masks, the SiLU's exp) is the
bottleneck, not HBM; shifting by `pltpu.roll` instead of unaligned ref
slices made both passes markedly cheaper.
"""

import dataclasses
import functools
from typing import Annotated, ClassVar

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops import partitioning
from tokamax_gdn.ops.causal_conv1d import base
from tokamax_gdn.ops.causal_conv1d import pallas_mosaic_tpu_kernel as kernel
from tokamax_gdn.ops.causal_conv1d import xla
from tokamax_gdn.ops.tiling import round_up  # pylint: disable=g-importing-member

_MIB = 1 << 20
_LANES = 128
_SUBLANES = 16     # bf16 native tiling; also a multiple of the 8-row halo


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling: block_d channels (lanes, a multiple of 128) x block_t tokens (a
  multiple of 16).

  in_hbm: the forward kernel's x and y stay in HBM. Without it XLA may place
    them in VMEM where the program leaves room (the serving op's chunked
    path, a long prefill: x and y of 12-24 MiB each), and libtpu's static
    cycle estimator then takes time and host memory that grow faster than
    T on this kernel. The blocks are streamed either way; at 512-token tiles
    the estimate in HBM matches 256-token tiles in VMEM.
  """

  block_d: Annotated[int, pydantic.Field(gt=0, multiple_of=_LANES)] = 512
  block_t: Annotated[int, pydantic.Field(gt=0, multiple_of=_SUBLANES)] = 256
  in_hbm: bool = False


def _tiles(cfg: Config, t: int, d: int) -> tuple[int, int]:
  """Effective (block_t, block_d): never larger than the (rounded-up) array."""
  return (min(cfg.block_t, round_up(max(t, 1), _SUBLANES)),
          min(cfg.block_d, round_up(d, _LANES)))


def heuristic_tiles(t: int, d: int, block_t: int = 256) -> Config:
  """The heuristic tiling of x [B, t, d]: the widest of 512 / 256 / 128
  lanes that divides d (rounded up to lanes), `block_t` tokens at most."""
  dp = round_up(d, _LANES)
  block_d = next(c for c in (512, 256, 128) if dp % c == 0)
  return Config(block_d=block_d, block_t=min(block_t, round_up(max(t, 1), _SUBLANES)))


def _heuristics(ba: op.BoundArguments) -> Config:
  x = ba.arguments["x"]
  # v6e static estimates at T=4096, D=8192 bf16 are within ~10 % across
  # 512-1024 x 256-512 tiles; 512x256 keeps VMEM small (see module doc).
  return heuristic_tiles(x.shape[1], x.shape[2])


def _autotuning_configs(ba: op.BoundArguments) -> set[Config]:
  """Power-of-two tiles up to the (rounded-up) array, plus the heuristic choice."""
  x = ba.arguments["x"]
  t, d = x.shape[1], x.shape[2]
  space = {Config(block_d=bd, block_t=bt)
           for bd in (128, 256, 512, 1024) if bd <= round_up(d, _LANES)
           for bt in (64, 128, 256, 512, 1024) if bt <= round_up(max(t, 1), _SUBLANES)}
  return space | {_heuristics(ba)}


def _vmem_limit(bt: int, bd: int, width: int, itemsize: int) -> int:
  """Backward (the larger kernel): double-buffered x, dy, dx tiles + halos + f32 scratch."""
  tile = bt * bd
  est = 2 * 3 * tile * itemsize + 2 * 4 * kernel.HALO * bd * 4 + (2 * tile + 3 * kernel.HALO * bd) * 4
  est += 2 * (width + 1) * bd * 4 + 2 * (bt + kernel.HALO) * kernel.REACH_LANES * 4
  cap = gdn_config.target_generation().vmem_bytes * 3 // 4
  return int(min(cap, max(32 * _MIB, 2 * est)))


def _check_supported(x: jax.Array, width: int) -> bool:
  """Returns interpret mode; raises NotImplementedError where the kernels can't run."""
  interpret = gdn_config.require_pallas_tpu("causal_conv1d")
  if x.dtype not in (jnp.float32, jnp.bfloat16):
    raise NotImplementedError(f"pallas_mosaic_tpu supports float32/bfloat16 x; got {x.dtype}.")
  if width - 1 > kernel.HALO:
    raise NotImplementedError(f"pallas_mosaic_tpu supports W <= {kernel.HALO + 1}; got {width}.")
  return interpret


@dataclasses.dataclass(frozen=True)
class _Prepared:
  x: jax.Array          # [B, Tp, Dp], x's dtype
  x_prev: jax.Array     # [B, nT, 8, Dp] f32
  w_t: jax.Array        # [W, Dp] f32
  bias: jax.Array | None    # [1, Dp] f32
  reach: jax.Array | None   # [B, Tp, 128] int32
  bt: int
  bd: int


def _prepare(x, weight, bias, initial_state, reach, cfg: Config) -> _Prepared:
  b, t, d = x.shape
  width = weight.shape[1]
  bt, bd = _tiles(cfg, t, d)
  tp, dp = round_up(max(t, 1), bt), round_up(d, bd)
  xp = jnp.pad(x, ((0, 0), (0, tp - t), (0, dp - d)))
  state = (jnp.zeros((b, width - 1, d), jnp.float32) if initial_state is None
           else initial_state.astype(jnp.float32))
  first = jnp.pad(state, ((0, 0), (kernel.HALO - (width - 1), 0), (0, dp - d)))
  x_prev = kernel.halo_prev(xp.astype(jnp.float32), bt, first)
  w_t = jnp.pad(weight.astype(jnp.float32).T, ((0, 0), (0, dp - d)))
  bias_p = None if bias is None else jnp.pad(bias.astype(jnp.float32), (0, dp - d))[None]
  reach_p = None
  if reach is not None:
    reach_p = jnp.pad(reach, ((0, 0), (0, tp - t)), constant_values=width - 1)
    reach_p = jnp.broadcast_to(reach_p[..., None], (b, tp, kernel.REACH_LANES))
  return _Prepared(xp, x_prev, w_t, bias_p, reach_p, bt, bd)


def conv_tokens(x: jax.Array, weight: jax.Array, bias: jax.Array | None, *,
                activation: str | None, config: Config) -> jax.Array:
  """act(conv(x)) [B, T, D] from zero history: the forward kernel alone, for
  other ops' kernels on one device (the serving op's chunked path), without
  the op's dispatch, custom VJP or sharding wrapper. weight [D, W]."""
  interpret = _check_supported(x, weight.shape[1])
  if x.size == 0:
    return jnp.zeros(x.shape, x.dtype)
  t, d = x.shape[1:]
  p = _prepare(x, weight, bias, None, None, config)
  y = kernel.conv_fwd(
      p.x, p.x_prev, p.w_t, p.bias, p.reach, bt=p.bt, bd=p.bd, activation=activation,
      interpret=interpret, in_hbm=config.in_hbm,
      vmem_limit_bytes=_vmem_limit(p.bt, p.bd, weight.shape[1], x.dtype.itemsize))
  return y[:, :t, :d]


# Dimension labels for `ops.partitioning`: channels D are independent ("h").
_LABELS = dict(x="b t h", dy="b t h", weight="h w", bias="h",
               initial_state="b s h", reach="b t")


def _per_shard(body, out_labels, arrays: dict):
  """body(**arrays) per batch/channel shard under jit with sharded inputs."""
  return partitioning.call_per_shard(body, arrays, _LABELS, out_labels,
                                     key_heads=arrays["x"].shape[2])


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuCausalConv1d(config_hooks.PallasTpuHooks, base.CausalConv1d[Config, None]):
  """Tiled causal conv1d + SiLU in Pallas Mosaic TPU (forward + backward kernels)."""

  op_name: ClassVar[str] = "causal_conv1d"
  config_cls: ClassVar[type[Config]] = Config
  heuristics = _heuristics
  autotuning_configs = _autotuning_configs
  max_width: ClassVar[int | None] = kernel.HALO + 1

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", PallasMosaicTpuCausalConv1dVjp())

  def _conv(self, x, weight, bias, *, activation, initial_state, reach, config: Config):
    interpret = _check_supported(x, weight.shape[1])
    if x.size == 0:  # B, T or D is 0: no tile to run (and no tile size to divide by).
      return jnp.zeros(x.shape, x.dtype)

    def body(x, weight, bias, initial_state, reach):
      t, d = x.shape[1:]  # per device
      p = _prepare(x, weight, bias, initial_state, reach, config)
      y = kernel.conv_fwd(
          p.x, p.x_prev, p.w_t, p.bias, p.reach, bt=p.bt, bd=p.bd, activation=activation,
          interpret=interpret, in_hbm=config.in_hbm,
          vmem_limit_bytes=_vmem_limit(p.bt, p.bd, weight.shape[1], x.dtype.itemsize))
      return (y[:, :t, :d],)

    (y,) = _per_shard(body, ["b t h"], dict(
        x=x, weight=weight, bias=bias, initial_state=initial_state, reach=reach))
    return y


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuCausalConv1dVjp(config_hooks.PallasTpuHooks, op.Op):
  """Backward: one Pallas kernel for dx / dweight / dbias; XLA for the W-1-token edges."""

  op_name: ClassVar[str] = "causal_conv1d"
  config_cls: ClassVar[type[Config]] = Config
  heuristics = _heuristics
  autotuning_configs = _autotuning_configs

  def _fwd(
      self,
      residuals: None,
      out: base.Output,
      dout: base.Output,
      x: jax.Array,
      weight: jax.Array,
      bias: jax.Array | None,
      *,
      activation: str | None,
      initial_state: jax.Array | None,
      output_final_state: bool,
      segment_ids: jax.Array | None,
      return_residuals: bool,
      config: Config,
  ) -> tuple[dict[str, jax.Array], None]:
    del residuals, out, return_residuals
    width = weight.shape[1]
    interpret = _check_supported(x, width)
    b, t, d = x.shape
    dy, d_final = dout
    reach = base.window_reach(segment_ids, width)
    grads = {}
    if x.size == 0:
      dx = jnp.zeros_like(x)
      dweight = jnp.zeros(weight.shape, jnp.float32)
      dbias = jnp.zeros((d,), jnp.float32)
    else:

      def body(x, weight, bias, initial_state, reach, dy):
        t, d = x.shape[1:]  # per device
        p = _prepare(x, weight, bias, initial_state, reach, config)
        dyp = jnp.pad(dy.astype(x.dtype), ((0, 0), (0, p.x.shape[1] - t), (0, p.x.shape[2] - d)))
        x_next = kernel.halo_next(p.x.astype(jnp.float32), p.bt)
        dy_next = kernel.halo_next(dyp.astype(jnp.float32), p.bt)
        reach_next = None if p.reach is None else kernel.halo_next(p.reach, p.bt)
        dx, dwp, dbp = kernel.conv_bwd(
            p.x, p.x_prev, x_next, dyp, dy_next, p.w_t, p.bias, p.reach, reach_next,
            bt=p.bt, bd=p.bd, activation=activation, interpret=interpret,
            vmem_limit_bytes=_vmem_limit(p.bt, p.bd, width, x.dtype.itemsize))
        # Per-row weight/bias partials: the sum over rows (and shards) is XLA's.
        return dx[:, :t, :d], jnp.sum(dwp, axis=1)[..., :d], jnp.sum(dbp, axis=(1, 2))[..., :d]

      dx, dw_rows, db_rows = _per_shard(body, ["b t h", "b w h", "b h"], dict(
          x=x, weight=weight, bias=bias, initial_state=initial_state, reach=reach, dy=dy))
      dweight = jnp.sum(dw_rows, axis=0).T
      dbias = jnp.sum(db_rows, axis=0)
    if initial_state is not None:
      # Only the first W-1 tokens read the initial state: differentiate those in XLA.
      n = min(t, width - 1)
      conv = functools.partial(
          xla.IMPLEMENTATION._conv, x[:, :n], weight, bias,  # pylint: disable=protected-access
          activation=activation, reach=None if reach is None else reach[:, :n], config=None)
      _, state_vjp = jax.vjp(lambda s: conv(initial_state=s), initial_state)
      (d_state,) = state_vjp(dy[:, :n].astype(jnp.float32))
      d_state = d_state.astype(jnp.float32)
    if output_final_state and d_final is not None:
      fs = lambda x_, s_: base.final_state(x_, s_, segment_ids, width)
      _, fs_vjp = jax.vjp(fs, x, initial_state)
      dx_f, ds_f = fs_vjp(d_final.astype(x.dtype))
      dx = dx.astype(jnp.float32) + dx_f.astype(jnp.float32)
      if initial_state is not None:
        d_state = d_state + ds_f.astype(jnp.float32)
    grads["x"] = dx.astype(x.dtype)
    grads["weight"] = dweight.astype(weight.dtype)
    # `bias` is positional: a None gradient keeps the args tuple whole.
    grads["bias"] = None if bias is None else dbias.astype(bias.dtype)
    if initial_state is not None:
      grads["initial_state"] = d_state.astype(initial_state.dtype)
    return grads, None


IMPLEMENTATION = PallasMosaicTpuCausalConv1d()
