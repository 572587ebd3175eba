"""Loss, optimizer and the jitted training step of the decoder (optax AdamW).

loss = mean over answer positions of −log p(target)
       + router_aux_loss_coef · (mean over blocks of the MoE load-balancing loss)
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn.models import decoder
from tokamax_gdn.models.config import ModelConfig

try:
  import optax
except ImportError as e:  # pragma: no cover - depends on the install
  raise ImportError(
      "tokamax_gdn.training needs optax: pip install 'tokamax_gdn[flax]'.") from e

# Leaves that get no weight decay: norms (zero-centred: decay would pull them
# to scale 1, not 0) and the GDN gate parameters (log-space).
_NO_DECAY = ("norm", "a_log", "dt_bias")


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """How a step runs (hashable: a jit static argument).

  implementation: for every op, as `models.forward` takes it.
  dtype: activation dtype; None: the params' dtype.
  remat, remat_policy: `models.forward`'s (a `jax.checkpoint` per block, and
    what it keeps).
  scan: `models.forward`'s (`lax.scan` over the layers, or a Python loop);
    None: `scan_layers`'s choice, a loop for models of at most
    `UNROLL_MAX_LAYERS` layers.
  """

  implementation: Any = None
  dtype: Any = None
  remat: bool = False
  scan: bool | None = None
  remat_policy: str = "recompute"


# Under `lax.scan` the backward's residuals of every layer are written into
# arrays stacked over the layers and read back from them (dynamic-update-slice
# and dynamic-slice copies, and relayouts between the stacked and the per-layer
# layouts): on the v5e chip a quarter of a small model's step
# (docs/performance.md "chip-train-scan"). A Python loop keeps each layer's
# residuals where they were made, at the cost of a compile that grows with the
# depth; past this many layers the scan keeps the compile time flat.
UNROLL_MAX_LAYERS = 8


def scan_layers(cfg: ModelConfig, step_cfg: StepConfig) -> bool:
  """Whether the step runs the layers under `lax.scan` (`StepConfig.scan`)."""
  if step_cfg.scan is not None:
    return step_cfg.scan
  return cfg.num_layers > UNROLL_MAX_LAYERS


def loss_fn(params, batch, cfg: ModelConfig, step_cfg: StepConfig = StepConfig(), mesh=None):
  """(total loss, metrics) on one batch (tokens, targets, mask), each [B, T]."""
  tokens, targets, mask = batch
  logits, stats = decoder.forward(
      params, tokens, cfg, implementation=step_cfg.implementation, dtype=step_cfg.dtype,
      remat=step_cfg.remat, scan=scan_layers(cfg, step_cfg), mesh=mesh,
      remat_policy=step_cfg.remat_policy)
  logp = jax.nn.log_softmax(logits, axis=-1)
  # The target's log-probability as a masked sum over the vocabulary rather
  # than a gather: its gradient is then elementwise (fused into the softmax's)
  # where a gather's is a scatter into a [B, T, V] zero array.
  nll = -jnp.sum(jnp.where(jax.nn.one_hot(targets, logits.shape[-1], dtype=bool), logp, 0.0),
                 axis=-1)
  weight = mask.astype(jnp.float32)
  count = jnp.maximum(jnp.sum(weight), 1.0)
  loss = jnp.sum(nll * weight) / count
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32) * weight
  metrics = dict(loss=loss, accuracy=jnp.sum(correct) / count, aux_loss=stats["aux_loss"],
                 dropped=jnp.sum(stats["dropped"]))
  return loss + cfg.router_aux_loss_coef * stats["aux_loss"], metrics


def make_optimizer(learning_rate: float, steps: int, *, warmup_steps: int = 0,
                   weight_decay: float = 0.01, clip_norm: float = 1.0,
                   b1: float = 0.9, b2: float = 0.98) -> optax.GradientTransformation:
  """AdamW with linear warmup then cosine decay to 10 %, global-norm clipping,
  and no weight decay on norms / GDN gate parameters."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, max(warmup_steps, 0), max(steps, warmup_steps + 1),
      end_value=0.1 * learning_rate)

  def decay_mask(params):
    def keep(path, _):
      names = [str(getattr(k, "key", "")) for k in path]
      return not any(s in n for n in names for s in _NO_DECAY)
    return jax.tree_util.tree_map_with_path(keep, params)

  return optax.chain(
      optax.clip_by_global_norm(clip_norm),
      optax.adamw(schedule, b1=b1, b2=b2, weight_decay=weight_decay, mask=decay_mask))


def train_step(params, opt_state, batch, *, cfg: ModelConfig, optimizer, step_cfg: StepConfig,
               mesh=None):
  """One AdamW update: (params, opt_state, metrics); jit it with `cfg`,
  `optimizer`, `step_cfg` and `mesh` bound (see `make_train_step`)."""
  grads, metrics = jax.grad(loss_fn, has_aux=True)(params, batch, cfg, step_cfg, mesh)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  params = optax.apply_updates(params, updates)
  metrics["grad_norm"] = optax.tree.norm(grads)
  return params, opt_state, metrics


def make_train_step(cfg: ModelConfig, optimizer, step_cfg: StepConfig = StepConfig(), mesh=None,
                    donate: bool = True):
  """`train_step` jitted for this model, optimizer and step config (params and
  optimizer state donated: updated in place)."""
  def step(params, opt_state, batch):
    return train_step(params, opt_state, batch, cfg=cfg, optimizer=optimizer,
                      step_cfg=step_cfg, mesh=mesh)
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())
