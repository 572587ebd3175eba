"""Chunked (WY / UT) gated delta rule in pure JAX, with an analytical backward.

The Op part: config, heuristics, autotuning space and the VJP wiring. The
chunk algebra (docs/gdn_math.md: notation, forward and backward
equations) is in `xla_chunked_kernel.py`, one function per stage, with the
block and chunk scans.
"""

import dataclasses
import typing
from typing import Any, ClassVar, Literal

import jax
import pydantic
from typing_extensions import override

from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops.gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import prologue
from tokamax_gdn.ops.gated_delta_rule import xla_chunked_kernel as kernel

BlockSize = Literal[256, 512, 1024, 2048, 4096, 8192, 16384]
_DEFAULT_BLOCK = 2048


@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the chunked computation.

  chunk_size: tokens per chunk of the WY/UT decomposition (C x C matrices).
  block_size: tokens per block of the outer scan. Chunk-parallel work
    (the C x C matrices, WY factors) is batched over one block's chunks at a
    time, so temporaries are O(block_size) instead of O(T) and the cost stays
    linear in T; the forward saves the f32 state entering each block
    (K V 4 / block_size bytes per token and value head) for the backward.
  """

  chunk_size: Literal[16, 32, 64, 128] = 64
  block_size: BlockSize = _DEFAULT_BLOCK


def _heuristics(t: int) -> Config:
  """C=64 (16/32 for shorter sequences); blocks of 512 tokens on CPU, 2048
  elsewhere.

  On CPU, blocks of 512 tokens keep the per-block temporaries in cache and
  beat 2048 (`tokamax-gdn autotune --impl xla` times every block size;
  docs/gdn_pallas_tpu.md, "Heuristics' measurements"). Accelerators get longer blocks,
  since each block is a sequential step and its chunks are the parallel
  width.
  """
  block = 512 if jax.default_backend() == "cpu" else _DEFAULT_BLOCK
  for c in (16, 32):
    if t <= c:
      return Config(chunk_size=c, block_size=block)
  return Config(chunk_size=64, block_size=block)


def _chunk_sizes(t: int) -> set[Config]:
  """Chunk sizes at the heuristic block (the VJP's configs)."""
  block = _heuristics(t).block_size
  return {Config(chunk_size=c, block_size=block) for c in (16, 32, 64, 128)}


def _autotuning_configs(t: int) -> set[Config]:
  """Chunk sizes at the heuristic block, block sizes at C=64.

  Block sizes of T or more all run as one block; only the smallest is kept.
  """
  configs = _chunk_sizes(t)
  for blk in typing.get_args(BlockSize):
    if blk // 2 < t:
      configs.add(Config(chunk_size=64, block_size=blk))
  return configs


@dataclasses.dataclass(frozen=True)
class XlaGatedDeltaRule(config_hooks.ConfigHooks, base.GatedDeltaRule[Config, Any]):
  """Chunked WY/UT gated delta rule lowered by XLA; analytical backward."""

  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = prologue.CHUNKED_LOG_DECAY_FLOOR
  supports_segment_states: ClassVar[bool] = True

  heuristics = config_hooks.of_size(_heuristics, "query", 1)
  autotuning_configs = config_hooks.of_size(_autotuning_configs, "query", 1)

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", XlaGatedDeltaRuleVjp())

  @override
  def _core_fwd(self, q, k, v, log_decay, beta, *, scale, initial_state,
                segment_ids, config):
    out, final, block_entries = kernel.chunked_forward(
        q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk_size=config.chunk_size,
        block_size=config.block_size)
    return out, final, base.Residuals(states=block_entries)


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaGatedDeltaRuleVjp(config_hooks.ConfigHooks, base.GatedDeltaRuleVjp[Config, Any]):
  """Analytical backward of `XlaGatedDeltaRule` (reverse scan over blocks).

  It runs over the forward's blocks, whose entry states it gets as residuals:
  `block_size` of its config applies only without residuals (called on its
  own), so it autotunes the chunk size alone.
  """

  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = prologue.CHUNKED_LOG_DECAY_FLOOR
  heuristics = config_hooks.of_size(_heuristics, "query", 1)
  autotuning_configs = config_hooks.of_size(_chunk_sizes, "query", 1)

  @override
  def _core_bwd(self, residuals, q, k, v, log_decay, beta, d_out, d_final, *,
                scale, initial_state, segment_ids, config):
    chunk = config.chunk_size
    t_len = kernel.scanned_length(q.shape[1], initial_state, chunk)
    block, states = config.block_size, None
    if residuals is not None:
      block = forward_block_size(t_len, chunk, residuals.states)
      states = residuals.states
    return kernel.chunked_backward(
        q, k, v, log_decay, beta, d_out, d_final, scale=scale,
        initial_state=initial_state, segment_ids=segment_ids,
        chunk_size=chunk, block_size=block, block_entries=states)


def forward_block_size(t_len: int, chunk: int, states: jax.Array | None) -> int:
  """The forward's block length, from the number of block states it saved.

  None: it ran as one block, so the backward does too. Otherwise the block
  size with that many blocks, unique among the powers of two of `BlockSize`
  (ceil(T / L) > ceil(T / 2L) whenever the latter is above one).
  """
  if states is None:
    return -(-t_len // chunk) * chunk
  for blk in typing.get_args(BlockSize):
    if -(-t_len // blk) == states.shape[2]:
      return blk
  raise ValueError(f"{states.shape[2]} saved block states fit no block size at T={t_len}.")


IMPLEMENTATION = XlaGatedDeltaRule()
