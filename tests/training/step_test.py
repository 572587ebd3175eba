"""Training steps: the loss falls, Pallas (interpret mode) steps equal xla
steps, the optimizer leaves norms undecayed, and the profiled split adds up.

One short training run (module fixture, one compile) serves both the loss and
the profiled-split checks: `train` profiles its step 1."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn import layers
from tokamax_gdn.models import ModelConfig, init_params
from tokamax_gdn.testing.specs import tolerance
from tokamax_gdn.training import (  # pylint: disable=g-multiple-import
    RecallTask, StepConfig, TrainConfig, make_optimizer, make_train_step, train)

TOY = ModelConfig(
    gdn=layers.GatedDeltaNetConfig(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                   head_v_dim=16),
    num_layers=2, full_attention_interval=2, num_attention_heads=2, num_key_value_heads=1,
    head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=16)
# One GDN block (and its MoE): every Pallas kernel (GDN, conv, gmm/tgmm
# forward and backward) once, at the least interpret-mode compile time.
ONE_BLOCK = dataclasses.replace(TOY, num_layers=1, full_attention_interval=0)


def _steps(impl, n, task, cfg, batch):
  params = init_params(jax.random.key(0), cfg)
  opt = make_optimizer(1e-2, 10)
  opt_state = opt.init(params)
  step = make_train_step(cfg, opt, StepConfig(implementation=impl), donate=False)
  losses = []
  for i in range(n):
    params, opt_state, m = step(params, opt_state, task.batch(jax.random.key(i), batch))
    losses.append(float(m["loss"]))
  return losses


def test_pallas_interpret_steps_equal_xla_steps():
  task = RecallTask(num_pairs=2, num_queries=2, num_keys=4, num_values=4)
  want = _steps("xla", 2, task, ONE_BLOCK, batch=2)
  with config.interpret_mode(True):
    got = _steps("pallas_mosaic_tpu", 2, task, ONE_BLOCK, batch=2)
  np.testing.assert_allclose(got, want, rtol=tolerance(jnp.bfloat16, grad=False))
  assert want[1] != want[0]          # the second step saw updated params


def test_optimizer_does_not_decay_norms_or_gates():
  params = jax.eval_shape(lambda: init_params(jax.random.key(0), TOY))
  params = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), params)
  opt = make_optimizer(1.0, 10, weight_decay=0.5)
  zeros = jax.tree.map(jnp.zeros_like, params)
  updates, _ = jax.jit(opt.update)(zeros, jax.jit(opt.init)(params), params)
  for path, u in jax.tree_util.tree_leaves_with_path(updates):
    name = jax.tree_util.keystr(path)
    decayed = bool(jnp.any(u != 0))
    assert decayed == (("norm" not in name) and ("a_log" not in name)
                       and ("dt_bias" not in name)), name


@pytest.fixture(scope="module")
def short_run():
  """The toy model trained on CPU with xla (step 1 profiled): (result, seconds)."""
  task = RecallTask(num_pairs=2, num_queries=2, num_keys=4, num_values=4)
  t0 = time.perf_counter()
  result = train(TOY, task, TrainConfig(steps=60, batch_size=32, learning_rate=3e-3,
                                        warmup_steps=5, eval_sequences=64, profile_step=1,
                                        stop_at_accuracy=0.9,
                                        step=StepConfig(implementation="xla")))
  return result, time.perf_counter() - t0


def test_training_halves_the_loss(short_run):
  """The answer loss falls below half its start (learning to answer with a
  value seen in the context already does that: ln 2 < ln 8 / 2 with 2 pairs
  and 8 tokens),
  within the 60 s the issue gives."""
  result, seconds = short_run
  end = sum(h["loss"] for h in result.history[-5:]) / 5
  assert end < result.start_loss / 2, [round(h["loss"], 3) for h in result.history]
  assert result.eval_loss < result.start_loss / 2
  print(f"{len(result.history)} steps, {result.start_loss:.3f} -> {end:.3f}, {seconds:.1f} s")


def test_generated_recall_differs_only_after_wrong_answers(short_run):
  """Recall with generated answers (same sequences as the teacher-forced
  figure) can differ from it only at answers after a wrong one in the same
  sequence: with 2 queries by at most the teacher-forced error rate."""
  result, _ = short_run
  assert result.generated_recall is not None
  assert abs(result.generated_recall - result.recall_accuracy) <= 1 - result.recall_accuracy + 1e-6


def test_profiled_split_adds_up(short_run):
  """The profiled step found GDN and gmm/tgmm instructions (the split is by
  the compiled step's instruction names) and its parts sum to the step."""
  result, _ = short_run
  split = result.split
  assert split["gdn"] > 0 and split["gmm/tgmm"] > 0 and split["rest"] > -1e-9
  assert split["gdn"] + split["gmm/tgmm"] + split["rest"] == pytest.approx(split["step"])
  assert np.isfinite(result.history[1]["loss"])     # the profiled step ran the update
  assert result.history[2]["loss"] != result.history[1]["loss"]


def test_layers_unrolled_up_to_the_limit_and_scanned_past_it():
  """`StepConfig.scan` None: a Python loop over at most `UNROLL_MAX_LAYERS`
  layers, `lax.scan` past it; an explicit choice wins; the step
  takes it (its program has the layers' loops only when they are scanned)."""
  from tokamax_gdn.training import step as step_lib  # pylint: disable=g-import-not-at-top
  limit = step_lib.UNROLL_MAX_LAYERS
  at, past = (dataclasses.replace(TOY, num_layers=n) for n in (limit, limit + 2))
  assert not step_lib.scan_layers(at, StepConfig())
  assert step_lib.scan_layers(past, StepConfig())
  assert step_lib.scan_layers(at, StepConfig(scan=True))
  assert not step_lib.scan_layers(past, StepConfig(scan=False))
  task = RecallTask(num_pairs=2, num_queries=2, num_keys=4, num_values=4)
  batch = task.batch(jax.random.key(0), 2)

  def loops(cfg, step_cfg):
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), cfg))
    opt = make_optimizer(1e-2, 10)
    step = make_train_step(cfg, opt, step_cfg, donate=False)
    return step.lower(params, jax.eval_shape(opt.init, params), batch).as_text().count(
        "stablehlo.while")

  # (The ops have loops of their own: the layers' scan adds to them.)
  assert loops(TOY, StepConfig(implementation="xla")) < loops(
      TOY, StepConfig(implementation="xla", scan=True))
