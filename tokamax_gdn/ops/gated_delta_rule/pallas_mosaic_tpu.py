"""Pallas Mosaic TPU gated delta rule: Op wrapper (config, heuristics, VMEM, VJP).

The kernels (chunked WY forward, reverse-chunk analytical backward) live in
`pallas_mosaic_tpu_kernel.py`; their math is at the top of that module.

The shared prologue (q/k L2-norm, gate activation -exp(a_log)·softplus(g+dt_bias))
runs in XLA before the kernel (`base.prologue`) and is differentiated by
autodiff in `base.GatedDeltaRuleVjp`; beta scaling, the in-chunk decay masks,
segment resets and the tail mask are inside the kernels.

Residuals for the backward, per token and value head, beyond the op inputs
tokamax keeps anyway:
  - `save_states=False` (heuristic default): 0 bytes; the backward recomputes
    the chunk-entry states with one extra forward-kernel pass (transient
    K·V·4/C bytes per token per head, 0.5 KiB at K=V=128 and the default
    C=128, live only during the backward).
  - `save_states=True`: the float32 chunk-entry states, K·V·4/C bytes
    (0.5 KiB/token/head at K=V=128 and the default C=128; 1 KiB at C=64),
    kept from forward to backward.
"""

import dataclasses
import functools
from typing import Annotated, Any, ClassVar, Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member
import pydantic
from tokamax._src.ops import op
from typing_extensions import override

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import partitioning
from tokamax_gdn.ops.gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_kernel as kernel

_MIB = 1 << 20


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the Mosaic TPU GDN kernels.

  chunk_size: tokens per chunk C (the WY block; the inverse costs O(C) per token).
  block_heads: value heads per grid step (a multiple of Hv/Hk dividing Hv; on
    TPU also the whole head axis or a multiple of the sublane tiling, see
    `valid_block_heads`; other values are rounded up to a valid one). Lets the
    backward sum dq/dk over a GVA group inside the kernel.
  save_states: keep the f32 chunk-entry states from the forward (K·V·4/C bytes
    per token·head) instead of recomputing them in the backward.
  """

  chunk_size: Literal[32, 64, 128] = 128
  block_heads: Annotated[int, pydantic.Field(gt=0)] = 2
  save_states: bool = False


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def valid_block_heads(hv: int, hk: int, itemsize: int = 4, tpu: bool = True) -> list[int]:
  """Value-head tiles the kernels accept.

  A multiple of the GVA group dividing Hv; on a TPU the head axis of a block is
  the sublane axis of the (C, heads, D) tile, so both the value-head tile and
  its key-head tile must be the whole axis or a multiple of the dtype's
  sublane tiling (8 rows of 32-bit, 16 of 16-bit).
  """
  group = hv // hk
  sub = 32 // itemsize
  ok = lambda n, full: n == full or n % sub == 0
  return [h for h in range(group, hv + 1, group) if hv % h == 0
          and (not tpu or (ok(h, hv) and ok(h // group, hk)))]


def _effective_block_heads(requested: int, hv: int, hk: int, itemsize: int = 4,
                           tpu: bool = True) -> int:
  valid = valid_block_heads(hv, hk, itemsize, tpu)
  at_least = [h for h in valid if h >= requested]
  return at_least[0] if at_least else valid[-1]


def vmem_estimate(*, chunk: int, block_heads: int, group: int, dk: int, dv: int,
                  itemsize: int) -> int:
  """Upper estimate of the backward kernel's VMEM (the larger of the two)."""
  dk, dv = _round_up(dk, 128), _round_up(dv, 128)
  kb = max(block_heads // group, 1)
  key_blk = chunk * kb * dk * itemsize
  val_blk = chunk * block_heads * dv * itemsize
  scal_blk = block_heads * 8 * _round_up(chunk, 128) * 4  # (8, C) f32 scalar packs
  state_blk = block_heads * dk * dv * 4
  # in: q, k, v, dO, states, dS_T; out: dq, dk, dv, dg packs, dh0 — double-buffered.
  blocks = 2 * (4 * key_blk + 3 * val_blk + 2 * scal_blk + 3 * state_blk)
  scratch = state_blk
  # The head loop is unrolled and Mosaic keeps per-head values live: calibrated
  # on the Qwen3-Next shape (hb=32, C=128 needs 48-58 MiB on tpu7x/v6e).
  temps = block_heads * 8 * chunk * (chunk + max(dk, dv)) * 4 + 2 * kb * chunk * dk * 4
  return blocks + scratch + temps


def _vmem_limit(gen: gdn_config.TpuGeneration, estimate: int) -> int:
  return int(min(gen.vmem_bytes * 3 // 4, max(2 * estimate, 32 * _MIB)))


def _shapes(ba: op.BoundArguments) -> tuple[int, int, int, int, int]:
  q, v = ba.arguments["query"], ba.arguments["value"]
  return q.shape[-2], v.shape[-2], q.shape[-1], v.shape[-1], jnp.dtype(q.dtype).itemsize


def _heuristics(ba: op.BoundArguments) -> Config:
  hk, hv, dk, dv, isz = _shapes(ba)
  gen = gdn_config.target_generation()
  # Two value heads per step (or one GVA group, if larger) keeps the unrolled
  # body small and leaves B·Hv/hb parallel steps for both TensorCores.
  tpu = not gdn_config.interpret_enabled()
  hb = _effective_block_heads(2, hv, hk, isz, tpu)
  # Static cycle estimates (T=256, Hv=2, bf16, K=V=128): C=128 beats C=64 on
  # v5e (fwd 18.6k vs ~23k cycles) and v6e (17.7k vs 23.5k; bwd 23.9k vs 33.8k):
  # per-grid-step overhead dominates at these sizes; it also halves saved states.
  chunk = 128
  budget = gen.vmem_bytes * 5 // 8
  while vmem_estimate(chunk=chunk, block_heads=hb, group=hv // hk, dk=dk, dv=dv,
                      itemsize=isz) > budget:
    smaller = [h for h in valid_block_heads(hv, hk, isz, tpu) if h < hb]
    if smaller:
      hb = smaller[-1]
    elif chunk > 32:
      chunk //= 2
    else:
      break
  return Config(chunk_size=chunk, block_heads=hb, save_states=False)


def _autotuning_configs(ba: op.BoundArguments) -> set[Config]:
  hk, hv, dk, dv, isz = _shapes(ba)
  gen = gdn_config.target_generation()
  budget = gen.vmem_bytes * 5 // 8
  configs = {_heuristics(ba)}
  tpu = not gdn_config.interpret_enabled()
  for chunk in (32, 64, 128):
    for hb in valid_block_heads(hv, hk, isz, tpu)[:4]:
      est = vmem_estimate(chunk=chunk, block_heads=hb, group=hv // hk, dk=dk, dv=dv,
                          itemsize=isz)
      if est <= budget:
        configs.add(Config(chunk_size=chunk, block_heads=hb, save_states=False))
  return configs


def _check_supported(q: jax.Array, v: jax.Array) -> bool:
  """Returns interpret mode; raises NotImplementedError where the kernels can't run."""
  interpret = gdn_config.interpret_enabled()
  if not interpret and not gdn_config.on_tpu():
    raise NotImplementedError(
        "pallas_mosaic_tpu needs a TPU (or tokamax_gdn.config.interpret_mode()).")
  if q.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != q.dtype:
    raise NotImplementedError(
        f"pallas_mosaic_tpu supports float32/bfloat16 q, k, v of one dtype; got"
        f" {q.dtype}, {v.dtype}.")
  return interpret


def _kernel_tiling(config: Config, q: jax.Array, v: jax.Array, interpret: bool) -> dict:
  """Kernel tiling keywords for these (per-device) shapes."""
  hk, hv = q.shape[2], v.shape[2]
  hb = _effective_block_heads(config.block_heads, hv, hk, q.dtype.itemsize, not interpret)
  est = vmem_estimate(chunk=config.chunk_size, block_heads=hb, group=hv // hk,
                      dk=q.shape[3], dv=v.shape[3], itemsize=q.dtype.itemsize)
  return dict(chunk=config.chunk_size, block_heads=hb, lane_pad=not interpret,
              interpret=interpret,
              vmem_limit_bytes=_vmem_limit(gdn_config.target_generation(), est))


# Dimension labels of the kernels' operands (see `ops.partitioning`).
_LABELS = dict(
    q="b t h k", k="b t h k", v="b t hv v", log_decay="b t hv", beta="b t hv",
    d_out="b t hv v", d_final="b hv k v", initial_state="b hv k v",
    states="b hv n kp vp", segment_ids="b t",
)


def _per_shard(body, out_labels, hk: int, hv: int, arrays: dict):
  """body(**arrays) per batch/key-head shard under jit with sharded inputs."""
  return partitioning.call_per_shard(body, arrays, _LABELS, out_labels,
                                     key_heads=hk, group=hv // hk)


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuGatedDeltaRule(base.GatedDeltaRule[Config, None]):
  """Chunked gated delta rule in Pallas Mosaic TPU (forward + analytical VJP)."""

  config_cls: ClassVar[type[Config]] = Config
  max_head_dim: ClassVar[int | None] = 256
  log_decay_floor: ClassVar[float | None] = base.CHUNKED_LOG_DECAY_FLOOR

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", PallasMosaicTpuGatedDeltaRuleVjp())

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    return _heuristics(ba)

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    return _autotuning_configs(ba)

  @override
  def supported_on(self, device: jax.Device) -> bool:
    return gdn_config.pallas_tpu_supported(device)

  def _core_fwd(self, q, k, v, log_decay, beta, *, scale, initial_state,
                segment_ids, config: Config):
    interpret = _check_supported(q, v)

    def body(q, k, v, log_decay, beta, initial_state, segment_ids):
      return kernel.gdn_fwd(
          q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
          segment_ids=segment_ids, emit_states=config.save_states,
          **_kernel_tiling(config, q, v, interpret))

    out_labels = [_LABELS["d_out"], _LABELS["d_final"]]
    if config.save_states:
      out_labels.append(_LABELS["states"])
    res = _per_shard(body, out_labels, q.shape[2], v.shape[2], dict(
        q=q, k=k, v=v, log_decay=log_decay, beta=beta,
        initial_state=initial_state, segment_ids=segment_ids))
    out, final = res[:2]
    states = res[2] if config.save_states else None
    return out, final, base.Residuals(states=states)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuGatedDeltaRuleVjp(base.GatedDeltaRuleVjp[Config, None]):
  """Reverse-chunk analytical backward of the Mosaic TPU GDN kernels."""

  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = base.CHUNKED_LOG_DECAY_FLOOR

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Config:
    return _heuristics(ba)

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Config]:
    return _autotuning_configs(ba)

  @override
  def supported_on(self, device: jax.Device) -> bool:
    return gdn_config.pallas_tpu_supported(device)

  def _core_bwd(self, residuals: base.Residuals | None, q, k, v, log_decay, beta, d_out, d_final, *,
                scale, initial_state, segment_ids, config: Config):
    interpret = _check_supported(q, v)
    t = q.shape[1]
    states = getattr(residuals, "states", None)
    # States saved under another chunk size can't be reused: recompute.
    if states is not None and states.shape[2] != -(-t // config.chunk_size):
      states = None

    def body(q, k, v, log_decay, beta, d_out, d_final, states, initial_state,
             segment_ids):
      return kernel.gdn_bwd(
          q, k, v, log_decay, beta, d_out, d_final, states, scale=scale,
          initial_state=initial_state, segment_ids=segment_ids,
          **_kernel_tiling(config, q, v, interpret))

    out_labels = [_LABELS[n] for n in ("q", "k", "v", "log_decay", "beta", "d_final")]
    return _per_shard(body, out_labels, q.shape[2], v.shape[2], dict(
        q=q, k=k, v=v, log_decay=log_decay, beta=beta, d_out=d_out,
        d_final=d_final, states=states, initial_state=initial_state,
        segment_ids=segment_ids))


IMPLEMENTATION = PallasMosaicTpuGatedDeltaRule()
