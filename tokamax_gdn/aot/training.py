"""Ahead-of-time compile of one whole training step for a TPU slice, on CPU.

`compile_train_step(cfg, target="tpu7x")` lowers `training.step.train_step`
(forward, backward through the custom VJPs, AdamW update) with the Pallas
kernels for a mesh of the target's chips with axes ("data", "model"): the
batch over "data", GDN heads and expert columns over "model" (see
`models.sharding`), expert weights and their optimizer moments stored split
over "model", everything else replicated. It compiles through libtpu
(`tokamax_gdn.aot`), which runs Mosaic's real passes, and reports the
compiler's memory per device.
"""

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from tokamax_gdn import aot
from tokamax_gdn.models import decoder
from tokamax_gdn.models import sharding
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class TrainStepReport:
  """Per-device memory of the compiled step (bytes) and what was compiled."""

  target: str
  mesh_shape: tuple[int, int]
  batch: int
  seq_len: int
  implementation: str
  param_count: int
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  mosaic_kernels: int     # Pallas TPU custom calls in the compiled step

  def rows(self) -> list[dict[str, Any]]:
    """One table row per memory kind, MiB per device."""
    mib = lambda b: round(b / 2**20, 1)
    return [dict(memory="arguments (params, AdamW state, batch)", mib_per_device=mib(self.argument_bytes)),
            dict(memory="temporaries", mib_per_device=mib(self.temp_bytes)),
            dict(memory="outputs (updated params, state)", mib_per_device=mib(self.output_bytes))]


def _abstract(mesh, shapes, specs):
  return jax.tree.map(lambda s, p: aot.spec(mesh, s.shape, s.dtype, p), shapes, specs)


def compile_train_step(cfg: ModelConfig, *, target: str = "tpu7x", batch: int = 8,
                       seq_len: int = 2048, mesh_shape: tuple[int, int] = (2, 4),
                       implementation: str = "pallas_mosaic_tpu", dtype=jnp.bfloat16,
                       param_dtype=jnp.float32, remat: bool = True,
                       remat_policy: str = "recompute") -> TrainStepReport:
  """Compiles one AdamW training step of `cfg` for `target`; raises on failure.

  Args:
    mesh_shape: (data, model) chips; their product must not exceed the
      target topology's devices (tpu7x 2x2x1: 8 TensorCores).
    implementation: the ops' implementation for every op.
    dtype: activation dtype; params (and AdamW moments) are `param_dtype`.
    remat, remat_policy: `models.forward`'s.
  """
  n_data, n_model = mesh_shape
  mesh = aot.target_mesh(target, n_data * n_model, (sharding.DATA, sharding.MODEL), mesh_shape)
  optimizer = step_lib.make_optimizer(1e-3, 1000, warmup_steps=10)
  step_cfg = step_lib.StepConfig(implementation=implementation, dtype=dtype, remat=remat,
                                 scan=True, remat_policy=remat_policy)
  param_shapes = jax.eval_shape(
      lambda: decoder.init_params(jax.random.key(0), cfg, param_dtype))
  params = _abstract(mesh, param_shapes, sharding.param_specs(param_shapes))
  with aot.on_target(mesh):
    # The AdamW moments take their params' shardings (zeros_like propagates them).
    opt_state = jax.jit(optimizer.init).lower(params).compile()
    opt_shardings = opt_state.output_shardings
  opt_shapes = jax.eval_shape(optimizer.init, param_shapes)
  on_mesh = set(mesh.devices.flat)
  # Leaves made from constants (the step count) land on the host device: replicate them.
  opt_args = jax.tree.map(
      lambda s, sh: aot.spec(mesh, s.shape, s.dtype,
                             sh.spec if sh.device_set == on_mesh else P()),
      opt_shapes, opt_shardings)
  tok = aot.spec(mesh, (batch, seq_len), jnp.int32, P(sharding.DATA, None))
  batch_args = (tok, tok, aot.spec(mesh, (batch, seq_len), jnp.bool_, P(sharding.DATA, None)))

  def train_step(params, opt_state, batch_):
    return step_lib.train_step(params, opt_state, batch_, cfg=cfg, optimizer=optimizer,
                               step_cfg=step_cfg, mesh=mesh)

  shardings = lambda tree: jax.tree.map(lambda a: a.sharding, tree)
  # Updated params and state keep their layout and reuse the donated buffers,
  # as in a training loop.
  jitted = jax.jit(train_step, donate_argnums=(0, 1),
                   out_shardings=(shardings(params), shardings(opt_args),
                                  NamedSharding(mesh, P())))
  with aot.on_target(mesh):
    compiled = jitted.lower(params, opt_args, batch_args).compile()
  mem = compiled.memory_analysis()
  return TrainStepReport(
      target=target, mesh_shape=(n_data, n_model), batch=batch, seq_len=seq_len,
      implementation=implementation,
      param_count=sum(math.prod(s.shape) for s in jax.tree.leaves(param_shapes)),
      temp_bytes=int(mem.temp_size_in_bytes), argument_bytes=int(mem.argument_size_in_bytes),
      output_bytes=int(mem.output_size_in_bytes),
      mosaic_kernels=compiled.as_text().count("tpu_custom_call"))
