"""Multi-query associative recall (MQAR, as in Zoology): a task that needs
memory across tokens.

A sequence holds `num_pairs` key-value pairs, then `num_queries` of those keys
again, each followed by its value:

    k_1 v_1 k_2 v_2 ... k_n v_n   q_1 a_1 q_2 a_2 ... q_m a_m      (a_j = value of key q_j)

Keys are distinct within a sequence and drawn from `num_keys` key tokens;
values from `num_values` value tokens (repeats allowed); the queries are
distinct keys in random order. The model predicts the next token everywhere,
but the loss and the recall accuracy count only the answers: the prediction
made at each query key q_j must be a_j, which only the key-value pairs earlier
in the sequence can tell. Token ids: keys [0, num_keys), values
[num_keys, num_keys + num_values).
"""

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class RecallTask:
  """Shapes of the recall task (hashable: a jit static argument)."""

  num_pairs: int = 4
  num_queries: int = 4
  num_keys: int = 16
  num_values: int = 16

  def __post_init__(self):
    for f in ("num_pairs", "num_queries", "num_keys", "num_values"):
      if getattr(self, f) <= 0:
        raise ValueError(f"`{f}`={getattr(self, f)} must be positive.")
    if self.num_pairs > self.num_keys:
      raise ValueError(f"`num_pairs`={self.num_pairs} needs as many distinct keys; "
                       f"`num_keys`={self.num_keys}.")
    if self.num_queries > self.num_pairs:
      raise ValueError(f"`num_queries`={self.num_queries} exceeds `num_pairs`={self.num_pairs}"
                       " (queries are distinct keys).")

  @classmethod
  def for_seq_len(cls, seq_len: int, **kw) -> "RecallTask":
    """As many pairs as queries, filling `seq_len` (a multiple of 4)."""
    if seq_len <= 0 or seq_len % 4:
      raise ValueError(f"`seq_len`={seq_len}: the recall task needs a positive multiple of 4"
                       " (pairs then queries, two tokens each).")
    n = seq_len // 4
    kw.setdefault("num_keys", max(n, cls.num_keys))
    return cls(num_pairs=n, num_queries=n, **kw)

  @property
  def seq_len(self) -> int:
    return 2 * (self.num_pairs + self.num_queries)

  @property
  def vocab_size(self) -> int:
    return self.num_keys + self.num_values

  def batch(self, key: jax.Array, batch_size: int):
    """(tokens, targets, mask), each [batch_size, seq_len].

    targets[b, t] = tokens[b, t + 1] (0 at the end); mask marks the query
    keys, where the prediction is the answer.
    """
    k_keys, k_vals, k_query = jax.random.split(key, 3)
    n, m = self.num_pairs, self.num_queries
    # Distinct keys per row: the first n of a random permutation.
    keys = jnp.argsort(jax.random.uniform(k_keys, (batch_size, self.num_keys)), axis=-1)[:, :n]
    values = self.num_keys + jax.random.randint(k_vals, (batch_size, n), 0, self.num_values)
    which = jnp.argsort(jax.random.uniform(k_query, (batch_size, n)), axis=-1)[:, :m]
    q = jnp.take_along_axis(keys, which, axis=-1)
    a = jnp.take_along_axis(values, which, axis=-1)
    interleave = lambda x, y: jnp.stack([x, y], axis=-1).reshape(batch_size, -1)
    tokens = jnp.concatenate([interleave(keys, values), interleave(q, a)], axis=-1)
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((batch_size, 1), tokens.dtype)], axis=-1)
    is_query = (jnp.arange(self.seq_len) >= 2 * n) & (jnp.arange(self.seq_len) % 2 == 0)
    mask = jnp.broadcast_to(is_query, tokens.shape)
    return tokens.astype(jnp.int32), targets.astype(jnp.int32), mask
