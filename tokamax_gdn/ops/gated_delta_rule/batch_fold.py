"""Short rows run as one: B rows of T tokens as one row of B·T tokens, a
segment per row.

A chunked kernel computes whole chunks of C tokens: a row of T < C tokens
costs a chunk, mostly padding (at T = 16 and C = 128, 8x the work). The rows
of a batch are independent sequences, which is what packed segments are: so
a call with B > 1 rows of T < C tokens can run as a single row of B·T tokens
whose segment ids change at every row start (and wherever a row's own ids
change), about B·T / C chunks instead of B. The state resets at each row's
first token as at any segment start, and a NaN stays in its row as in its
segment (`isolation`).

Only where no state crosses the call: no initial state, no final state and
no residuals kept for a later call (those are per row and per chunk of the
row: segments inside a chunk have no state of their own in the kernels).
The fold and unfold are reshapes of the token axis; segment ids are the only
new array.
"""

import jax
import jax.numpy as jnp

from tokamax_gdn.ops import segments


def folds(b: int, t: int, chunk: int) -> bool:
  """Whether B rows of T tokens pay to run folded at chunk size C: B > 1 and
  T < C (rows of a chunk or more gain at most their last chunk's padding)."""
  return b > 1 and t < chunk


def fold(x: jax.Array) -> jax.Array:
  """[B, T, ...] -> [1, B·T, ...]: row b's tokens at [b·T, (b+1)·T)."""
  return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def unfold(x: jax.Array, b: int) -> jax.Array:
  """[1, B·T, ...] -> [B, T, ...], `fold`'s inverse."""
  return x.reshape(b, x.shape[1] // b, *x.shape[2:])


def segment_ids(ids: jax.Array | None, b: int, t: int) -> jax.Array:
  """Segment ids [1, B·T] int32 of the folded row: a new segment at every
  row's first token and wherever `ids` [B, T] (None: one segment per row)
  changes within a row."""
  starts = jnp.zeros((b, t), bool).at[:, 0].set(True)
  if ids is not None:
    starts = starts | segments.segment_starts(ids)
  return jnp.cumsum(fold(starts.astype(jnp.int32)), axis=1, dtype=jnp.int32)
