"""Recall with generated answers (tokamax_gdn.training.recall): the answers
are the full forward's greedy predictions on the sequence that holds the
model's own earlier answers and the task's queries."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import layers
from tokamax_gdn.models import ModelConfig, forward, init_params
from tokamax_gdn.training import RecallTask
from tokamax_gdn.training import recall

TOY = ModelConfig(
    gdn=layers.GatedDeltaNetConfig(hidden_size=32, num_k_heads=1, num_v_heads=2, head_k_dim=16,
                                   head_v_dim=16),
    num_layers=2, full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, vocab_size=12)
TASK = RecallTask(num_pairs=3, num_queries=3, num_keys=6, num_values=6)


def test_generated_answers_are_forward_predictions_in_their_own_context():
  # Output projections 20x their init: an untrained model's answers then vary
  # with the context (otherwise it would give one token everywhere).
  params = jax.tree_util.tree_map_with_path(
      lambda path, a: 20 * a if "proj" in str(path[-1]) else a,
      init_params(jax.random.key(0), TOY))
  # generated_recall's batch 0 below:
  tokens, _, _ = TASK.batch(jax.random.fold_in(jax.random.key(1), 0), 8)
  answers = np.asarray(recall.generated_answers(params, tokens, TOY, TASK, implementation="reference"))
  assert answers.shape == (8, TASK.num_queries)
  at = 2 * TASK.num_pairs + 1 + 2 * np.arange(TASK.num_queries)     # answer positions
  own = np.array(tokens).copy()
  own[:, at] = answers
  logits, _ = forward(params, jnp.asarray(own), TOY, implementation="reference", remat=False)
  # The forward's logit of each generated answer is its maximum (up to float
  # rounding: a near-tie may pick either).
  chosen = np.take_along_axis(np.asarray(logits)[:, at - 1], answers[..., None], -1)[..., 0]
  best = np.asarray(logits)[:, at - 1].max(-1)
  np.testing.assert_allclose(chosen, best, atol=1e-4)
  assert len(np.unique(answers)) > 1
  # generated_recall scores those answers against the task's.
  acc = recall.generated_recall(params, TOY, TASK, jax.random.key(1), 8, 1,
                                implementation="reference")
  truth = np.asarray(tokens)[:, at]
  assert acc == pytest.approx(np.mean(answers == truth))
