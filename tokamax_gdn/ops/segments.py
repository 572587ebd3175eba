"""Packed segments of the gated delta rule: where they start, which state each
one starts from, and the chunk-aligned layout of per-segment states.

`segment_ids` [B, T] packs several sequences in a row: a segment is a run of
equal ids, and the recurrent state restarts (a select, never a multiply by
zero) where the id changes (t > 0). With per-segment states, segment n of row
b starts from initial_state[b, n] and ends in final_state[b, n]; segments from
the N-th on start from zeros (`state_of_segment`) and their end states are not
kept (`store_segment_state`). Chunked backends run per-segment states on a
re-layout where every segment n < N starts at a chunk boundary
(`align_segments`; docs/gdn_math.md, "Per-segment states").

The one home of these rules: the reference, both chunked backends, context
parallelism and causal_conv1d's windows read them from here.
"""

import dataclasses
import functools

from typing import TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float  # pylint: disable=g-multiple-import,g-importing-member

from tokamax_gdn.ops import tiling

# A recurrent state operand: [B, Hv, K, V], or per-segment states [B, N, Hv, K, V].
State: TypeAlias = Float[Array, "B Hv K V"] | Float[Array, "B N Hv K V"]


def segment_starts(segment_ids: jax.Array | None) -> jax.Array | None:
  """[B, T] bool: True where a new segment starts (never at t = 0); None
  without `segment_ids`."""
  if segment_ids is None:
    return None
  changed = segment_ids[:, 1:] != segment_ids[:, :-1]
  return jnp.concatenate([jnp.zeros_like(changed[:, :1]), changed], axis=1)


def segment_index(segment_ids: jax.Array) -> jax.Array:
  """[B, T] int32: n for the tokens of the n-th run of equal ids in the row."""
  return jnp.cumsum(segment_starts(segment_ids), axis=1, dtype=jnp.int32)


def segment_first(starts: jax.Array) -> jax.Array:
  """[B, T] int32: the position of the first token of each token's segment,
  from `segment_starts`."""
  pos = jnp.arange(starts.shape[1], dtype=jnp.int32)
  return jax.lax.cummax(jnp.where(starts, pos, 0), axis=1)


def segment_ends(starts: jax.Array) -> jax.Array:
  """[B, T] bool: True at the last token of each segment, from `segment_starts`."""
  return jnp.concatenate([starts[:, 1:], jnp.ones_like(starts[:, :1])], axis=1)


def _per_row(flag: jax.Array, x: jax.Array) -> jax.Array:
  """flag [B, ...] broadcast against x's trailing axes."""
  return flag.reshape(flag.shape + (1,) * (x.ndim - flag.ndim))


def state_of_segment(states: jax.Array, segment: jax.Array) -> jax.Array:
  """The state each segment starts from: states [B, N, ...] at segment [B, ...]
  (row b reads states[b, segment[b, ...]]), zeros (False) from N on."""
  n = states.shape[1]
  rows = jnp.arange(states.shape[0]).reshape((-1,) + (1,) * (segment.ndim - 1))
  picked = states[rows, jnp.clip(segment, 0, n - 1)]
  return jnp.where(_per_row(segment < n, picked), picked, jnp.zeros((), picked.dtype))


def store_segment_state(states: jax.Array, segment: jax.Array, x: jax.Array,
                        where: jax.Array) -> jax.Array:
  """states [B, N, ...] with x [B, ...] stored at [b, segment[b]] for the rows
  where `where` [B] holds and segment < N (later segments keep no state)."""
  n = states.shape[1]
  rows = jnp.arange(states.shape[0])
  idx = jnp.clip(segment, 0, n - 1)
  keep = where & (segment < n)
  return states.at[rows, idx].set(jnp.where(_per_row(keep, x), x, states[rows, idx]))


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["position", "source", "segment", "chunk_segment", "chunk_reset",
                 "chunk_last", "num_segments"],
    meta_fields=["chunk_size", "num_states"])
@dataclasses.dataclass(frozen=True)
class SegmentLayout:
  """Packed segments re-laid so that each starts at a chunk boundary.

  Built by `align_segments` (see there and docs/gdn_math.md, "Per-segment states").
  In the aligned layout of static length Ta = round_up(T + N (C - 1), C),
  segments 0..N (N = `num_states`) each start at a chunk boundary and are
  followed by pad tokens up to the next one; segments past N follow each other
  without padding (they start from zero and their end states are not
  returned, so an in-chunk start, handled by the chunked code's in-chunk
  segment masks, is enough). Pads carry q = k = v = 0, g = 0, beta = 0: the
  state passes through them unchanged.

  Attributes (B rows, T tokens, Ta aligned positions, Nc = Ta / C chunks):
    position: [B, T] int32, each token's aligned position (strictly increasing).
    source: [B, Ta] int32, the token at each aligned position; T for a pad.
    segment: [B, Ta] int32, the segment index of each aligned position (a pad
      belongs to the segment it follows).
    chunk_segment: [B, Nc] int32, the segment of each chunk's first position.
    chunk_reset: [B, Nc] bool, a segment starts at the chunk's first position:
      the state entering the chunk is initial_state[b, chunk_segment] (zeros
      from segment N on), selected rather than decayed.
    chunk_last: [B, Nc] bool, the chunk is the last of its segment: the state
      leaving it is that segment's final state (kept when chunk_segment < N).
    num_segments: [B] int32, segments per row.
    chunk_size: C.
    num_states: N.
  """

  position: jax.Array
  source: jax.Array
  segment: jax.Array
  chunk_segment: jax.Array
  chunk_reset: jax.Array
  chunk_last: jax.Array
  num_segments: jax.Array
  chunk_size: int
  num_states: int

  @property
  def aligned_length(self) -> int:
    return self.source.shape[1]

  def to_aligned(self, x: jax.Array, fill: float = 0.0) -> jax.Array:
    """[B, T, ...] -> [B, Ta, ...], `fill` at the pads (differentiable)."""
    padded = jnp.concatenate([x, jnp.full_like(x[:, :1], fill)], axis=1)
    return padded[jnp.arange(x.shape[0])[:, None], self.source]

  def from_aligned(self, x: jax.Array) -> jax.Array:
    """[B, Ta, ...] -> [B, T, ...], the tokens' positions (differentiable)."""
    return x[jnp.arange(x.shape[0])[:, None], self.position]

  def in_chunk_starts(self) -> jax.Array:
    """[B, Ta] bool: segment starts that are not at a chunk boundary (only
    segments past N can start there)."""
    changed = segment_starts(self.segment)
    at_boundary = (jnp.arange(self.aligned_length) % self.chunk_size) == 0
    return changed & ~at_boundary


def aligned_length(t: int, num_states: int, chunk_size: int) -> int:
  """Ta of `align_segments`: round_up(T + N (C - 1), C)."""
  return tiling.round_up(t + num_states * (chunk_size - 1), chunk_size)


def align_segments(segment_ids: jax.Array, num_states: int, chunk_size: int) -> SegmentLayout:
  """The chunk-aligned layout of `segment_ids` [B, T] (T >= 1) for N states.

  Segment n < N is padded after its end to a multiple of C tokens, so that
  segments 1..N start at chunk boundaries (segment 0 starts at 0). Every
  token moves right by the padding of the segments before it; the total
  padding is at most N (C - 1), hence the static length
  Ta = round_up(T + N (C - 1), C).
  """
  b, t = segment_ids.shape
  c = chunk_size
  t_al = aligned_length(t, num_states, c)
  pos = jnp.arange(t, dtype=jnp.int32)
  starts = segment_starts(segment_ids)
  seg = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  seg_start = segment_first(starts)
  pad = jnp.where(segment_ends(starts) & (seg < num_states), (seg_start - pos - 1) % c, 0)
  position = pos + jnp.cumsum(pad, axis=1, dtype=jnp.int32) - pad
  rows = jnp.arange(b)[:, None]
  source = jnp.full((b, t_al), t, jnp.int32).at[rows, position].set(
      jnp.broadcast_to(pos, (b, t)))
  segment = jnp.full((b, t_al), -1, jnp.int32).at[rows, position].set(seg)
  segment = jax.lax.cummax(segment, axis=1)        # pads join the segment they follow
  chunk_segment = segment[:, ::c]
  chunk_reset = jnp.concatenate(
      [jnp.ones((b, 1), bool), chunk_segment[:, 1:] != segment[:, c - 1:-1:c]], axis=1)
  chunk_last = jnp.concatenate([chunk_reset[:, 1:], jnp.ones((b, 1), bool)], axis=1)
  return SegmentLayout(
      position=position, source=source, segment=segment,
      chunk_segment=chunk_segment, chunk_reset=chunk_reset, chunk_last=chunk_last,
      num_segments=seg[:, -1] + 1, chunk_size=c, num_states=num_states)
