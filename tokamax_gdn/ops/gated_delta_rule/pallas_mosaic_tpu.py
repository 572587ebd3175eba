"""Pallas Mosaic TPU gated delta rule: Op wrapper (config, heuristics, VMEM, VJP).

The kernels live in `pallas_mosaic_tpu_kernel.py` (their TPU-specific design
at the top of that module; the math in `math.md`).

The shared prologue (q/k L2-norm, gate activation -exp(a_log)·softplus(g+dt_bias),
the -30 floor) runs in XLA before the kernels (`base.prologue`), pointwise, and
is differentiated by autodiff in `base.GatedDeltaRuleVjp`. The in-chunk gate
cumsum, decay masks, segment resets, the partial last chunk and d log-decay
per token are inside the kernels.

Residuals for the backward, per token and value head, beyond the op inputs
tokamax keeps anyway:
  - `save_states=False` (heuristic default): 0 bytes; the backward first
    reruns the forward kernel without outputs to get the state entering each
    chunk and the chunk's WY inverse T' (K·V/C + C elements per token and
    head, bf16 for bf16 inputs: 384 B at K=V=C=128, live only during the
    backward).
  - `save_states=True`: the forward emits those and they are kept from
    forward to backward (the backward skips its first pass).
"""

import dataclasses
from typing import Annotated, ClassVar, Literal

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op
from typing_extensions import override

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import partitioning
from tokamax_gdn.ops.tiling import round_up
from tokamax_gdn.ops.gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_kernel as kernel

_MIB = 1 << 20


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the Mosaic TPU GDN kernels.

  chunk_size: tokens per chunk C (the WY block; the inverse costs O(C) per token).
  interleave: value heads whose stages run interleaved (each stage for all of
    them before the next): more hides more MXU latency but keeps more C×C
    tiles live in VMEM.
  save_states: keep the chunk-entry states and WY inverses from the forward
    (see the module docstring) instead of recomputing them in the backward.
  """

  chunk_size: Literal[64, 128, 256] = 128
  interleave: Annotated[int, pydantic.Field(gt=0)] = 16
  save_states: bool = False


def _shapes(ba: op.BoundArguments) -> tuple[int, int, int, int, int]:
  q, v = ba.arguments["query"], ba.arguments["value"]
  return q.shape[-2], v.shape[-2], q.shape[-1], v.shape[-1], jnp.dtype(q.dtype).itemsize


def vmem_estimate(*, chunk: int, hv: int, hk: int, dim_k: int, dim_v: int, itemsize: int,
                  interleave: int) -> int:
  """Upper estimate of the backward kernel's VMEM (the larger of the two).

  Double-buffered blocks (q, k, v, dO, dq, dk, dv; states and WY inverses in
  the input dtype; f32 per-token gate blocks), the f32 dS scratch, the
  head-major f32 copies of the blocks, and ~12 live C×C / C×D f32 tiles per
  interleaved head.
  """
  dim_k, dim_v = round_up(dim_k, 128), round_up(dim_v, 128)
  tok = chunk * (2 * hk * dim_k + 2 * hv * dim_v) * itemsize         # q, k, v, dO
  grads = chunk * (2 * hk * dim_k + hv * dim_v) * itemsize           # dq, dk, dv
  res = hv * (dim_k * dim_v + chunk * chunk) * itemsize               # states, T'
  gates = 4 * chunk * round_up(hv, 128) * 4
  blocks = 2 * (tok + grads + res + gates)
  scratch = hv * dim_k * dim_v * 4
  copies = chunk * (2 * hk * dim_k + 2 * hv * dim_v) * 4
  live = interleave * 12 * chunk * max(chunk, dim_k, dim_v) * 4
  return blocks + scratch + copies + live


def _vmem_limit(gen: gdn_config.TpuGeneration, estimate: int) -> int:
  return int(min(gen.vmem_bytes * 7 // 8, max(2 * estimate, 32 * _MIB)))


def _fits(cfg: Config, ba: op.BoundArguments) -> bool:
  hk, hv, dk, dv, isz = _shapes(ba)
  est = vmem_estimate(chunk=cfg.chunk_size, hv=hv, hk=hk, dim_k=dk, dim_v=dv, itemsize=isz,
                      interleave=min(cfg.interleave, hv))
  return est <= gdn_config.target_generation().vmem_bytes * 3 // 4


def _heuristics(ba: op.BoundArguments) -> Config:
  """C = 128 and 16 heads interleaved, fewer where VMEM is short.

  Static cycle estimates, v6e, B=1 T=256 Hk=16 Hv=32 K=V=128 bf16, forward
  kernel: interleave 8 / 16 / 32 heads: 51.7 k / 41.2 k / 42.9 k cycles.
  """
  hk, hv, *_ = _shapes(ba)
  cfg = Config(chunk_size=128, interleave=min(16, hv))
  while not _fits(cfg, ba) and (cfg.interleave > 1 or cfg.chunk_size > 64):
    if cfg.interleave > 4:
      cfg = Config(chunk_size=cfg.chunk_size, interleave=cfg.interleave // 2)
    elif cfg.chunk_size > 64:
      cfg = Config(chunk_size=cfg.chunk_size // 2, interleave=cfg.interleave)
    else:
      cfg = Config(chunk_size=cfg.chunk_size, interleave=max(1, cfg.interleave // 2))
  return cfg


def _autotuning_configs(ba: op.BoundArguments) -> set[Config]:
  hk, hv, *_ = _shapes(ba)
  configs = {_heuristics(ba)}
  for chunk in (64, 128, 256):
    for ilv in (4, 8, 16, 32):
      cfg = Config(chunk_size=chunk, interleave=min(ilv, hv))
      if _fits(cfg, ba):
        configs.add(cfg)
  return configs


def _check_supported(q: jax.Array, v: jax.Array) -> bool:
  """Returns interpret mode; raises NotImplementedError where the kernels can't run."""
  interpret = gdn_config.require_pallas_tpu("gated_delta_rule pallas_mosaic_tpu")
  if q.dtype not in (jnp.float32, jnp.bfloat16) or v.dtype != q.dtype:
    raise NotImplementedError(
        f"pallas_mosaic_tpu supports float32/bfloat16 q, k, v of one dtype; got"
        f" {q.dtype}, {v.dtype}.")
  if v.shape[2] > 128:
    raise NotImplementedError(f"pallas_mosaic_tpu supports up to 128 value heads; got {v.shape[2]}.")
  return interpret


def _kernel_args(config: Config, q: jax.Array, v: jax.Array, interpret: bool) -> dict:
  """Kernel keywords for these (per-device) shapes."""
  hk, hv = q.shape[2], v.shape[2]
  est = vmem_estimate(chunk=config.chunk_size, hv=hv, hk=hk, dim_k=q.shape[3],
                      dim_v=v.shape[3], itemsize=q.dtype.itemsize,
                      interleave=min(config.interleave, hv))
  return dict(chunk=config.chunk_size, interleave=config.interleave, interpret=interpret,
              vmem_limit_bytes=_vmem_limit(gdn_config.target_generation(), est))


# Dimension labels of the kernels' operands (see `ops.partitioning`).
_LABELS = dict(
    q="b t h k", k="b t h k", v="b t hv v", log_decay="b t hv", beta="b t hv",
    d_out="b t hv v", d_final="b hv k v", initial_state="b hv k v",
    states="b n hv kp vp", tmats="b n hv c1 c2", segment_ids="b t",
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
      out, final, res = kernel.gdn_fwd(
          q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
          segment_ids=segment_ids, emit_residuals=config.save_states,
          **_kernel_args(config, q, v, interpret))
      return (out, final) + (tuple(res) if res is not None else ())

    out_labels = [_LABELS["d_out"], _LABELS["d_final"]]
    if config.save_states:
      out_labels += [_LABELS["states"], _LABELS["tmats"]]
    res = _per_shard(body, out_labels, q.shape[2], v.shape[2], dict(
        q=q, k=k, v=v, log_decay=log_decay, beta=beta,
        initial_state=initial_state, segment_ids=segment_ids))
    out, final = res[:2]
    if config.save_states:
      return out, final, base.Residuals(states=res[2], tmats=res[3])
    return out, final, base.Residuals()


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
    tmats = getattr(residuals, "tmats", None)
    # Residuals saved under another chunk size can't be reused: recompute.
    if states is None or tmats is None or tmats.shape[-1] != config.chunk_size or (
        states.shape[1] != -(-t // config.chunk_size)):
      states = tmats = None

    def body(q, k, v, log_decay, beta, d_out, d_final, states, tmats, initial_state,
             segment_ids):
      return kernel.gdn_bwd(
          q, k, v, log_decay, beta, d_out, d_final, scale=scale,
          initial_state=initial_state, segment_ids=segment_ids,
          residuals=None if states is None else (states, tmats),
          **_kernel_args(config, q, v, interpret))

    out_labels = [_LABELS[n] for n in ("q", "k", "v", "log_decay", "beta", "d_final")]
    return _per_shard(body, out_labels, q.shape[2], v.shape[2], dict(
        q=q, k=k, v=v, log_decay=log_decay, beta=beta, d_out=d_out,
        d_final=d_final, states=states, tmats=tmats, initial_state=initial_state,
        segment_ids=segment_ids))


IMPLEMENTATION = PallasMosaicTpuGatedDeltaRule()
