"""The gated delta rule as the GatedDeltaNet layer calls it, and its roofline.

`LayerShape` names one layer call (B, T, Hk, Hv, K, V, activation dtype);
`abstract_inputs` and `layer_fns` build that call (q, k, v, the raw gate and
beta's logits in the activation dtype, float32 `a_log`/`dt_bias`,
`use_qk_l2norm=True`, `use_beta_sigmoid=True`),
so autotuning (`tokamax-gdn autotune`) tunes the cache entries the layer looks
up and `tokamax-gdn aot` compiles what the layer runs.

Roofline of the chunked algorithm, per token and value head at chunk C, head
dims K, V (forward; the notation of `docs/gdn_math.md`):

  FLOPs = 2 (C K [K Kᵀ] + C K [Q Kᵀ] + C K [W = T K̃] + C V [U = T Ṽ]
             + 3 K V [W S, Q S, K_outᵀ V′] + C V [P V′])

and forward+backward is 3x the forward. Minimal HBM traffic: the forward
reads q, k, v, g, beta once and writes the output once (plus the initial and
final states when given); forward+backward adds reading q, k, v, g, beta and
d_out again and writing dq, dk, dv, dg, dbeta.
"""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class LayerShape:
  """One layer's gated-delta-rule call: [B, T, Hk, K] keys, [B, T, Hv, V] values.

  `flat`: the call takes q, k, v and returns the output as [B, T, H D], the
  layout of the projections they come from and go to in the layer
  (`abstract_inputs` and `layer_fns` both follow it; see `layer_fns`).
  """

  b: int
  t: int
  hk: int
  hv: int
  k: int
  v: int
  dtype: Any = jnp.bfloat16
  flat: bool = False

  def __str__(self):
    return (f"B{self.b} T{self.t} Hk{self.hk} Hv{self.hv} K{self.k} V{self.v}"
            f" {jnp.dtype(self.dtype).name}")


def split_heads(x: jax.Array, dim: int) -> jax.Array:
  """[B, T, H D] -> [B, T, H, D] (heads of size `dim`)."""
  return x.reshape(*x.shape[:2], -1, dim)


def merge_heads(x: jax.Array) -> jax.Array:
  """[B, T, H, D] -> [B, T, H D]."""
  return x.reshape(*x.shape[:2], -1)


def layer_shape(args) -> LayerShape:
  """The LayerShape of a call's (query, key, value, ...) arguments."""
  q, _, v = args[:3]
  b, t, hk, k = q.shape
  return LayerShape(b=b, t=t, hk=hk, hv=v.shape[2], k=k, v=v.shape[3], dtype=v.dtype)


def abstract_inputs(s: LayerShape, sharding=None) -> tuple[jax.ShapeDtypeStruct, ...]:
  """(q, k, v, g, beta, a_log, dt_bias) of the layer's call, as ShapeDtypeStructs
  (q, k, v as [B, T, H D] where `s.flat`)."""
  sds = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
  heads = lambda h, d: (s.b, s.t, h * d) if s.flat else (s.b, s.t, h, d)
  return (
      sds(heads(s.hk, s.k), s.dtype), sds(heads(s.hk, s.k), s.dtype),
      sds(heads(s.hv, s.v), s.dtype), sds((s.b, s.t, s.hv), s.dtype),
      sds((s.b, s.t, s.hv), s.dtype),
      sds((s.hv,), jnp.float32), sds((s.hv,), jnp.float32),
  )


def step_loss(out: jax.Array) -> jax.Array:
  """The loss a training step is measured with: `jnp.square(out).sum()`, in
  out's dtype.

  It must use the outputs' values, as a model's loss does: under a plain
  sum(out) the cotangent is constant, the outputs are dead in the grad
  program and XLA removes the forward kernel (the Pallas "step" then ran only
  the backward's states pass and backward kernel: 204 k instead of 279 k
  estimated cycles at the Qwen3-Next shape, T=512, v6e).

  The loss is the harness's, not the layer's (a model's next layer takes the
  output): its square, sum and cotangent are glue in the step's count. In
  out's dtype, not widened to float32 first: under a `jax.checkpoint` policy
  that saves the output, JAX puts a `reduce_precision` on it (a saved
  residual the forward also reads), which XLA:TPU copies out as an op of its
  own when the sum widens (or takes a float32 accumulator), and fuses into
  the sum when it does not.
  """
  return jnp.square(out).sum()


def layer_fns(s: LayerShape, implementation, remat_policy: str | None = None):
  """(forward, forward+backward) of the layer's call on `abstract_inputs(s)`.

  With `s.flat` the functions take q, k, v as [B, T, H D] and split the
  heads, and the forward returns the output as [B, T, Hv V], as the layer
  makes its projections' outputs into heads and its output back for the
  output projection, so a compile sees the arrays as the layer has them.
  (The Pallas kernels read and write them [B, T, H D]: XLA folds the reshapes. As [B, T, H, D]
  arguments and result of a jit, laid out tiled over (H, D), XLA copies
  them into that layout and back: v6e, Qwen3-Next heads, T=512, 13.1 k
  cycles of glue on the forward's 75.4 k.)

  forward+backward is `jax.value_and_grad` of `step_loss(out)` with respect
  to all seven inputs, as a training step takes them (the loss is reported):
  the forward kernel, and everything the backward runs. With a
  `remat_policy` ("recompute", "save_gdn", "offload_gdn"; see
  `ops.gated_delta_rule.remat`) the call and the loss run under
  `jax.checkpoint` with that policy, as a model's block runs (its output is
  then internal to the region, and the square's VJP needs it, as the
  layer's gated norm does), with named residuals (under "recompute" too:
  nothing is kept, and the backward's rerun of the forward emits the
  residuals, so no states pass runs). The sum is inside the region too: outside it, the scalar
  loss's cotangent
  reached the region as a [B, T, Hv, V] broadcast of ones that XLA
  materialised (a cotangent no model has: a block's arrives from the next
  layer).
  """
  from tokamax_gdn.ops.gated_delta_rule import remat  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule  # pylint: disable=g-import-not-at-top
  named = remat_policy is not None

  def forward(q, k, v, g, beta, a_log, dt_bias):
    if s.flat:
      q, k, v = split_heads(q, s.k), split_heads(k, s.k), split_heads(v, s.v)
    out = gated_delta_rule(q, k, v, g, beta, a_log=a_log, dt_bias=dt_bias,
                           use_qk_l2norm=True, use_beta_sigmoid=True,
                           implementation=implementation,
                           named_residuals=named)[0]
    return merge_heads(out) if s.flat else out

  def loss(*xs):
    return step_loss(forward(*xs))

  if remat_policy is not None:
    loss = jax.checkpoint(loss, policy=remat.checkpoint_policy(remat_policy))

  return forward, jax.value_and_grad(loss, argnums=tuple(range(7)))


# The chunk C the benchmarks' tables count essential FLOPs at.
FLOPS_CHUNK = 64


def essential_flops(s: LayerShape, chunk: int, *, backward: bool) -> int:
  """Matmul FLOPs the chunked algorithm cannot avoid (module docstring)."""
  per_token_head = 2 * (3 * chunk * s.k + 2 * chunk * s.v + 3 * s.k * s.v)
  forward = per_token_head * s.b * s.t * s.hv
  return 3 * forward if backward else forward


def min_hbm_bytes(s: LayerShape, *, backward: bool, states: bool = False) -> int:
  """Bytes every implementation must move to or from HBM (module docstring)."""
  size = jnp.dtype(s.dtype).itemsize
  tokens = s.b * s.t
  inputs = tokens * size * (2 * s.hk * s.k + s.hv * s.v + 2 * s.hv)  # q, k, v, g, beta
  out = tokens * size * s.hv * s.v
  state = 2 * s.b * s.hv * s.k * s.v * 4 if states else 0
  forward = inputs + out + state
  if not backward:
    return forward
  return forward + (inputs + out) + inputs  # read again with d_out; write the gradients
