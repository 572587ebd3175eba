"""Recall accuracy with generated answers: the decoder answers the recall
task token by token through `models.generate` (state pools, KV cache), as it
would when serving, instead of reading every answer off one teacher-forced
forward pass.

A sequence `k_1 v_1 ... k_n v_n q_1 a_1 q_2 a_2 ... q_m a_m` is cut after
q_1: that prefix is the prompt. Then each answer is the model's greedy choice
and each later query key is given (`forced`), so the context of answer j
holds the model's own answers 1..j-1, right or wrong, where the
teacher-forced evaluation has the true ones. Both measure the same
sequences; they differ only where an earlier wrong answer changes a later
one.
"""

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.models.generation import generate
from tokamax_gdn.training.data import RecallTask


def generated_answers(params, tokens: jax.Array, cfg: ModelConfig, task: RecallTask, *,
                      implementation=None, dtype=None) -> jax.Array:
  """tokens [B, seq_len] (the task's layout) -> the generated answers [B, num_queries]."""
  prompt_len = 2 * task.num_pairs + 1
  rest = np.asarray(tokens[:, prompt_len:])           # a_1 q_2 a_2 ... q_m a_m
  is_query = np.arange(rest.shape[1]) % 2 == 1
  forced = np.where(is_query, rest, -1)
  out, _ = generate(params, tokens[:, :prompt_len], cfg, rest.shape[1],
                    implementation=implementation, forced=forced, dtype=dtype)
  return out[:, ::2]


def generated_recall(params, cfg: ModelConfig, task: RecallTask, key: jax.Array,
                     batch_size: int, num_batches: int, *, implementation=None,
                     dtype=None) -> float:
  """Fraction of answers generated right on `num_batches` fresh batches
  (the batches `training.evaluate` draws from the same key)."""
  correct = 0.0
  for i in range(num_batches):
    tokens, _, _ = task.batch(jax.random.fold_in(key, i), batch_size)
    answers = generated_answers(params, tokens, cfg, task, implementation=implementation,
                                dtype=dtype)
    truth = tokens[:, 2 * task.num_pairs + 1::2]
    correct += float(jnp.mean(answers == truth))
  return correct / num_batches
