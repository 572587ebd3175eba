"""Packed segments (`ops/segments.py`), against per-row loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn.ops import segments

IDS = np.array([[3, 3, 1, 1, 1, 3, 0], [2, 2, 2, 2, 2, 2, 2], [0, 1, 2, 3, 4, 5, 6]], np.int32)


def _runs(row):
  """Per token of one row: (segment index, first position, is the last token)."""
  seg, first = [], []
  for t, x in enumerate(row):
    new = t > 0 and x != row[t - 1]
    seg.append((seg[-1] + new) if t else 0)
    first.append(t if (new or t == 0) else first[-1])
  last = [t == len(row) - 1 or seg[t + 1] != seg[t] for t in range(len(row))]
  return seg, first, last


def test_starts_index_first_ends():
  ids = jnp.asarray(IDS)
  starts = segments.segment_starts(ids)
  assert segments.segment_starts(None) is None
  for b, row in enumerate(IDS.tolist()):
    seg, first, last = _runs(row)
    assert starts[b].tolist() == [t > 0 and row[t] != row[t - 1] for t in range(len(row))]
    assert segments.segment_index(ids)[b].tolist() == seg
    assert segments.segment_first(starts)[b].tolist() == first
    assert segments.segment_ends(starts)[b].tolist() == last


def test_state_of_segment_and_store():
  rng = np.random.default_rng(0)
  b, n = 3, 2
  states = rng.standard_normal((b, n, 4, 5)).astype(np.float32)
  segment = np.array([1, 2, 0], np.int32)           # row 1 is past N: zeros
  got = segments.state_of_segment(jnp.asarray(states), jnp.asarray(segment))
  for r in range(b):
    want = states[r, segment[r]] if segment[r] < n else np.zeros((4, 5), np.float32)
    np.testing.assert_array_equal(got[r], want)
  # Per-token segment indices [B, T] give [B, T, ...]; flags stay bool.
  per_token = np.array([[0, 1, 2], [2, 0, 0], [1, 1, 5]], np.int32)
  flags = rng.random((b, n)) > 0.5
  got = segments.state_of_segment(jnp.asarray(flags), jnp.asarray(per_token))
  assert got.dtype == jnp.bool_
  want = [[bool(flags[r, s]) if s < n else False for s in row]
          for r, row in enumerate(per_token.tolist())]
  assert got.tolist() == want
  x = rng.standard_normal((b, 4, 5)).astype(np.float32)
  where = np.array([True, True, False])
  stored = segments.store_segment_state(jnp.asarray(states), jnp.asarray(segment),
                                        jnp.asarray(x), jnp.asarray(where))
  want = states.copy()
  for r in range(b):
    if where[r] and segment[r] < n:
      want[r, segment[r]] = x[r]
  np.testing.assert_array_equal(stored, want)


def _layout_cases():
  # (segment ids of one row, N, C)
  return [
      ([0] * 5 + [1] * 3 + [2] * 9, 2, 4),     # segment 2 is past N: not aligned
      ([7] * 4 + [3] * 4, 3, 4),               # already aligned; fewer segments than N
      ([0, 1, 0, 1, 1, 1, 2], 5, 4),           # one-token segments; ids that come back
      ([4] * 10, 1, 16),                       # one segment, shorter than a chunk
  ]


@pytest.mark.parametrize("ids,n,c", _layout_cases())
def test_align_segments(ids, n, c):
  seg_ids = jnp.array([ids, ids[::-1]], jnp.int32)
  # Jitted, then read on the host: eager dispatch and per-element device
  # reads compiled ~120 programs per case.
  lay = jax.jit(segments.align_segments, static_argnums=(1, 2))(seg_ids, n, c)
  lay = jax.tree.map(np.asarray, lay)
  t = len(ids)
  t_al = -(-(t + n * (c - 1)) // c) * c
  assert lay.source.shape == (2, t_al) and lay.aligned_length == t_al
  for row in range(2):
    row_ids = [int(x) for x in seg_ids[row]]
    seg = [0]
    for a, b in zip(row_ids, row_ids[1:]):
      seg.append(seg[-1] + (a != b))
    assert int(lay.num_segments[row]) == seg[-1] + 1
    pos = [int(p) for p in lay.position[row]]
    assert pos == sorted(set(pos)) and pos[0] == 0 and pos[-1] < t_al
    for tok, p in enumerate(pos):
      assert int(lay.source[row, p]) == tok
      assert int(lay.segment[row, p]) == seg[tok]
      starts_segment = tok == 0 or seg[tok] != seg[tok - 1]
      if starts_segment and seg[tok] <= n:       # segments 0..N start chunks
        assert p % c == 0, (row, tok, p)
        assert bool(lay.chunk_reset[row, p // c])
        assert int(lay.chunk_segment[row, p // c]) == seg[tok]
      if starts_segment and seg[tok] > n:        # later ones follow without padding
        assert p == pos[tok - 1] + 1
    assert int(jnp.sum(lay.source[row] < t)) == t    # every other position is a pad
    kept_resets = lay.chunk_reset[row] & (lay.chunk_segment[row] <= n)
    assert int(jnp.sum(kept_resets)) == min(seg[-1] + 1, n + 1)
    # The last chunk of each segment: just before the next reset, or the end.
    resets = [int(i) for i in jnp.nonzero(lay.chunk_reset[row])[0]]
    lasts = [int(i) for i in jnp.nonzero(lay.chunk_last[row])[0]]
    assert lasts == [r - 1 for r in resets[1:]] + [t_al // c - 1]
  x = jax.random.normal(jax.random.key(0), (2, t, 3))
  x_al = lay.to_aligned(x)
  np.testing.assert_array_equal(lay.from_aligned(x_al), x)
  np.testing.assert_array_equal(jnp.where((lay.source < t)[..., None], 0.0, x_al), 0.0)
  # Differentiable both ways: the two maps are each other's transpose.
  ct = jax.random.normal(jax.random.key(1), x_al.shape)
  grad = jax.grad(lambda x: jnp.sum(lay.to_aligned(x) * ct))(x)
  np.testing.assert_array_equal(grad, lay.from_aligned(ct))
  assert not bool(jnp.any(lay.in_chunk_starts() & (lay.segment <= n)))
