"""`train`: the decoder on the recall task, with AdamW, a progress bar, a
final evaluation and one profiled step. Library code: it raises, and returns
a `TrainResult` for the caller (the CLI) to print."""

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tokamax_gdn import progress as progress_lib
from tokamax_gdn.models import decoder
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.training import profile
from tokamax_gdn.training import recall as recall_lib
from tokamax_gdn.training import step as step_lib
from tokamax_gdn.training import step_split
from tokamax_gdn.training.data import RecallTask


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  """A training run.

  stop_at_accuracy: stop once the mean training recall accuracy of the last
    `window` steps reaches it (None: run all `steps`). The reported accuracy
    is measured afterwards on fresh sequences either way.
  profile_step: the step run under the profiler (None: none), excluded from
    the step-time median.
  device_split: on a TPU, split that step's device time into GDN, gmm/tgmm,
    attention and the rest (`training.step_split`, `TrainResult.device_split`)
    in place of the CPU thunks' split (`TrainResult.split`), which off TPU is
    still taken.
  eval_sequences: fresh sequences for the final recall accuracy (rounded up
    to whole batches).
  generated_recall: also measure recall with the answers generated token by
    token (`training.recall`) on the same sequences.
  """

  steps: int = 300
  batch_size: int = 32
  learning_rate: float = 3e-3
  warmup_steps: int = 20
  weight_decay: float = 0.01
  seed: int = 0
  param_dtype: Any = jnp.float32
  step: step_lib.StepConfig = step_lib.StepConfig()
  eval_sequences: int = 256
  generated_recall: bool = True
  stop_at_accuracy: float | None = None
  window: int = 10
  profile_step: int | None = 1
  device_split: bool = False

  def __post_init__(self):
    for f in ("steps", "batch_size", "eval_sequences", "window"):
      if getattr(self, f) <= 0:
        raise ValueError(f"`{f}`={getattr(self, f)} must be positive.")
    if self.learning_rate <= 0:
      raise ValueError(f"`learning_rate`={self.learning_rate} must be positive.")


@dataclasses.dataclass
class TrainResult:
  """What a run measured. `history` has one dict per step (step, loss,
  accuracy, grad_norm, aux_loss, seconds). `recall_accuracy` is
  teacher-forced, `generated_recall` (None when not asked for) by
  generation. `device_split` (with `TrainConfig.device_split`, on a TPU):
  device seconds per `step_split` bucket of the profiled step."""

  history: list[dict[str, float]]
  eval_loss: float
  recall_accuracy: float
  compile_seconds: float
  step_seconds: float
  tokens_per_second: float
  total_seconds: float
  split: dict[str, float] | None
  params: Any
  opt_state: Any
  generated_recall: float | None = None
  device_split: dict[str, float] | None = None

  @property
  def start_loss(self) -> float:
    return self.history[0]["loss"]

  @property
  def end_loss(self) -> float:
    return self.history[-1]["loss"]


def check_vocab(cfg: ModelConfig, task: RecallTask) -> None:
  if cfg.vocab_size < task.vocab_size:
    raise ValueError(f"The model's vocab_size={cfg.vocab_size} is smaller than the task's"
                     f" {task.vocab_size} tokens.")


def evaluate(step, params, opt_state, task: RecallTask, key, batch_size: int,
             num_batches: int) -> tuple[float, float]:
  """(answer loss, recall accuracy) of `params` on `num_batches` fresh batches.

  Runs the compiled (non-donating) training step and discards its update:
  its metrics come from the forward pass on the current params, and reusing
  the step's executable saves compiling a separate forward.
  """
  losses, accs = [], []
  for i in range(num_batches):
    _, _, m = step(params, opt_state, task.batch(jax.random.fold_in(key, i), batch_size))
    losses.append(float(m["loss"]))
    accs.append(float(m["accuracy"]))
  return sum(losses) / num_batches, sum(accs) / num_batches


def train(cfg: ModelConfig, task: RecallTask, tcfg: TrainConfig = TrainConfig(), *,
          progress: bool = False, on_step: Callable[[dict[str, float]], None] | None = None
          ) -> TrainResult:
  """Trains `cfg` from scratch on `task`; see `TrainConfig`."""
  check_vocab(cfg, task)
  start = time.perf_counter()
  k_init, k_data, k_eval = jax.random.split(jax.random.key(tcfg.seed), 3)
  params = decoder.init_params(k_init, cfg, tcfg.param_dtype)
  optimizer = step_lib.make_optimizer(tcfg.learning_rate, tcfg.steps,
                                      warmup_steps=tcfg.warmup_steps,
                                      weight_decay=tcfg.weight_decay)
  opt_state = optimizer.init(params)
  make_batch = jax.jit(task.batch, static_argnums=1)
  batch = make_batch(jax.random.fold_in(k_data, 0), tcfg.batch_size)

  t0 = time.perf_counter()
  compiled = step_lib.make_train_step(cfg, optimizer, tcfg.step, donate=False).lower(
      params, opt_state, batch).compile()
  compile_seconds = time.perf_counter() - t0

  tokens = tcfg.batch_size * task.seq_len
  history, times, split, device_split = [], [], None, None
  bar = progress_lib.bar(total=tcfg.steps, desc="train", disable=not progress, unit="step",
                         dynamic_ncols=True)
  try:
    for i in range(tcfg.steps):
      t0 = time.perf_counter()
      if i == tcfg.profile_step and tcfg.device_split:
        text = compiled.as_text()
        (params, opt_state, metrics), wall, events = profile.traced_call(
            compiled, params, opt_state, batch)
        device_split = step_split.device_split(events, text)
        if device_split is None:    # no device track (CPU): the thunks' split
          split = profile.split_events(profile.instruction_groups(text), events, wall)
      elif i == tcfg.profile_step:
        (params, opt_state, metrics), split = profile.profiled_call(
            compiled, params, opt_state, batch)
      else:
        params, opt_state, metrics = compiled(params, opt_state, batch)
      batch = make_batch(jax.random.fold_in(k_data, i + 1), tcfg.batch_size)
      row = {k: float(v) for k, v in metrics.items()}
      seconds = time.perf_counter() - t0
      row.update(step=i, seconds=seconds)
      history.append(row)
      if i != tcfg.profile_step:
        times.append(seconds)
      bar.update(1)
      bar.set_postfix(loss=f"{row['loss']:.3f}", recall=f"{row['accuracy']:.0%}",
                      tok_s=f"{tokens / seconds:,.0f}")
      if on_step is not None:
        on_step(row)
      recent = [h["accuracy"] for h in history[-tcfg.window:]]
      if (tcfg.stop_at_accuracy is not None and len(recent) == tcfg.window
          and sum(recent) / len(recent) >= tcfg.stop_at_accuracy):
        break
  finally:
    bar.close()

  eval_batches = -(-tcfg.eval_sequences // tcfg.batch_size)
  eval_loss, recall = evaluate(compiled, params, opt_state, task, k_eval, tcfg.batch_size,
                               eval_batches)
  generated = None
  if tcfg.generated_recall:
    generated = recall_lib.generated_recall(
        params, cfg, task, k_eval, tcfg.batch_size, eval_batches,
        implementation=tcfg.step.implementation, dtype=tcfg.step.dtype)
  step_seconds = statistics.median(times) if times else history[-1]["seconds"]
  return TrainResult(
      history=history, eval_loss=eval_loss, recall_accuracy=recall,
      compile_seconds=compile_seconds, step_seconds=step_seconds,
      tokens_per_second=tokens / step_seconds, total_seconds=time.perf_counter() - start,
      split=split, params=params, opt_state=opt_state, generated_recall=generated,
      device_split=device_split)
