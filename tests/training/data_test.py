"""The recall task: pairs then queries, answers where the mask says."""

import jax
import numpy as np
import pytest

from tokamax_gdn.training import RecallTask


def test_batch_layout_and_answers():
  task = RecallTask(num_pairs=6, num_queries=4, num_keys=10, num_values=7)
  tokens, targets, mask = map(np.asarray, task.batch(jax.random.key(0), 64))
  assert tokens.shape == targets.shape == mask.shape == (64, task.seq_len) == (64, 20)
  np.testing.assert_array_equal(targets[:, :-1], tokens[:, 1:])
  np.testing.assert_array_equal(mask.sum(-1), 4)
  for row, tgt, m in zip(tokens, targets, mask):
    keys, values = row[0:12:2], row[1:12:2]
    assert len(set(keys)) == 6 and keys.max() < 10                  # distinct key tokens
    assert values.min() >= 10 and values.max() < 17                # value tokens
    table = dict(zip(keys, values))
    queries = row[12::2]
    assert len(set(queries)) == 4 and set(queries) <= set(keys)
    np.testing.assert_array_equal(np.flatnonzero(m), np.arange(12, 20, 2))
    for q, a in zip(row[m], tgt[m]):
      assert table[q] == a                                        # the answer is q's value
  assert task.vocab_size == 17
  # Fresh keys give fresh sequences.
  assert not np.array_equal(tokens, np.asarray(task.batch(jax.random.key(1), 64)[0]))


def test_for_seq_len_and_errors():
  task = RecallTask.for_seq_len(64)
  assert task.seq_len == 64 and task.num_pairs == task.num_queries == 16
  with pytest.raises(ValueError, match="multiple of 4"):
    RecallTask.for_seq_len(30)
  with pytest.raises(ValueError, match="distinct keys"):
    RecallTask(num_pairs=8, num_keys=4)
  with pytest.raises(ValueError, match="exceeds"):
    RecallTask(num_pairs=2, num_queries=3)
