"""A training step measured: tokens/s, MFU and where its device time goes.

`measure_step(cfg, task, implementation, batch_size=..., steps=...)` compiles
the AdamW step (`training.step`, params and optimizer state donated, as a
training loop runs it), runs `warmup` steps, times `steps` more issued back
to back and waited for once (the steady state of a loop whose host runs
ahead of the chip; one batch, reused, so data generation is not timed), then
profiles `profile_calls` steps and splits their device time into GDN,
gmm/tgmm, attention and the rest (`training.step_split`; None off TPU).

What `tokamax-gdn train --compare-impls` runs for each implementation in
one process, so the implementations are compared on the same chip, model,
shapes and FLOP count. Errors (an implementation that does not compile or
run out of memory) are caught and reported in the measurement, so the
other implementations' rows still come.
"""

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.models import decoder
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.training import flops as flops_lib
from tokamax_gdn.training import profile
from tokamax_gdn.training import step as step_lib
from tokamax_gdn.training import step_split
from tokamax_gdn.training.data import RecallTask


@dataclasses.dataclass
class StepMeasurement:
  """One implementation's step. `split`: device seconds per bucket of one
  step (`step_split.BUCKETS` and "device", their sum), None off TPU or when
  not profiled. `top_ops`: `step_split.top_instructions` of the profiled
  step when asked for (`measure_step(top_ops=N)`), None off TPU. `error`:
  why there is no measurement (then the times are None)."""

  implementation: str
  batch_size: int
  seq_len: int
  flops: flops_lib.StepFlops
  compile_seconds: float | None = None
  step_seconds: float | None = None
  split: dict[str, float] | None = None
  top_ops: list[dict[str, Any]] | None = None
  error: str | None = None

  @property
  def tokens_per_second(self) -> float | None:
    return self.batch_size * self.seq_len / self.step_seconds if self.step_seconds else None

  def mfu(self, peak_flops: float | None) -> float | None:
    """Model FLOPs per second over `peak_flops` (None without either)."""
    return flops_lib.mfu(self.flops.total, self.step_seconds or 0.0, peak_flops)


@dataclasses.dataclass(frozen=True)
class ChipRates:
  """The FLOP/s MFU is taken against: the generation's published bf16 peak
  and a bf16 matmul's rate measured in this run (None off TPU)."""

  device_kind: str
  generation: str | None
  peak_flops: float | None
  matmul_flops: float | None


def chip_rates(measure: bool = True) -> ChipRates:
  """The default device's rates; on a TPU with `measure`, also times a bf16
  8192³ matmul (`benchmarks.timing.measure_floors`). Off TPU both are None:
  a CPU has no published peak here, and an 8192³ matmul takes minutes there."""
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import timing  # pylint: disable=g-import-not-at-top
  kind = jax.devices()[0].device_kind
  gen = config.generation_from_device_kind(kind)
  if gen is None:
    return ChipRates(device_kind=kind, generation=None, peak_flops=None, matmul_flops=None)
  peak = timing.PEAKS.get(gen.name)
  matmul = timing.measure_floors(stream_bytes=1 << 26).mxu_flops if measure else None
  return ChipRates(device_kind=kind, generation=gen.name, peak_flops=peak[0] if peak else None,
                   matmul_flops=matmul)


def _error(e: BaseException) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:300]


def measure_step(cfg: ModelConfig, task: RecallTask, implementation: Any, *, batch_size: int,
                 steps: int = 10, warmup: int = 2, dtype: Any = None, seed: int = 0,
                 learning_rate: float = 1e-3, profile_calls: int = 1,
                 step_cfg: step_lib.StepConfig | None = None,
                 top_ops: int = 0) -> StepMeasurement:
  """Measures one implementation's training step (module docstring).

  dtype: activation dtype (None: the params', float32), as
  `StepConfig.dtype`; `step_cfg` overrides both it and `implementation`.
  top_ops: list that many instructions of the profiled step, most device
  time first (`StepMeasurement.top_ops`).
  """
  m = StepMeasurement(implementation=str(implementation), batch_size=batch_size,
                      seq_len=task.seq_len,
                      flops=flops_lib.step_flops(cfg, batch_size, task.seq_len))
  step_cfg = step_cfg or step_lib.StepConfig(implementation=implementation, dtype=dtype)
  state: list[Any] = []
  try:
    k_init, k_data = jax.random.split(jax.random.key(seed))
    params = decoder.init_params(k_init, cfg)
    optimizer = step_lib.make_optimizer(learning_rate, warmup + steps + profile_calls)
    opt_state = optimizer.init(params)
    batch = task.batch(k_data, batch_size)
    t0 = time.perf_counter()
    compiled = step_lib.make_train_step(cfg, optimizer, step_cfg).lower(
        params, opt_state, batch).compile()
    m.compile_seconds = time.perf_counter() - t0
    state[:] = [params, opt_state]
    del params, opt_state

    def call():
      state[0], state[1], metrics = compiled(state[0], state[1], batch)
      return metrics

    for _ in range(warmup):
      jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(steps):
      metrics = call()      # one device stream: the last step is ready after all
    jax.block_until_ready((state, metrics))
    m.step_seconds = (time.perf_counter() - t0) / steps
    if profile_calls:
      events = profile.trace_calls(call, profile_calls)
      text = compiled.as_text()
      m.split = step_split.device_split(events, text, calls=profile_calls)
      if top_ops:
        m.top_ops = step_split.top_instructions(events, text, n=top_ops, calls=profile_calls)
  except Exception as e:  # pylint: disable=broad-except
    m.error = _error(e)
  finally:
    state.clear()           # frees the params and moments before the next implementation
  return m
