"""Named gated-RMSNorm workloads: conformance cases and Qwen3-Next/3.5 shapes.

The conformance suite reads 'conformance' (and 'interpret': small enough
for Pallas interpret mode); the model shapes ('aot' and model tags) are the
GatedDeltaNet layer's output norm: x and gate [B, T, Hv·V], normalised per
value head (groups of V).
"""

import jax
import jax.numpy as jnp

from tokamax_gdn.autotuning import ArgSpec

DIFF = ("x", "gate", "weight")


def random_inputs(key: jax.Array, *, shape: tuple[int, ...], v: int | None = None,
                  dtype=jnp.float32, weight_dtype=None, eps: float = 1e-6):
  """Random inputs (never zeros) as (args, kwargs): x and gate [*shape] ~
  N(0, 1), weight [V] ~ 1 + N(0, 0.3²) (a trained norm weight sits around
  1); V defaults to the last axis (one group)."""
  kx, kg, kw = jax.random.split(key, 3)
  x = jax.random.normal(kx, shape, jnp.float32).astype(dtype)
  gate = jax.random.normal(kg, shape, jnp.float32).astype(dtype)
  weight = (1.0 + 0.3 * jax.random.normal(kw, (v or shape[-1],), jnp.float32)).astype(
      weight_dtype or dtype)
  return (x, gate, weight), dict(eps=eps)


def _spec(name, *, tags=("conformance", "interpret"), **kw):
  return ArgSpec(name=name, make=lambda key: random_inputs(key, **kw), diff_argnames=DIFF,
                 tags=tags)


ARG_SPECS: list[ArgSpec] = [
    _spec("B2_T24_H3_V16", shape=(2, 24, 48), v=16),       # small heads: viewed as [., V]
    _spec("rows37_V128", shape=(37, 128)),                 # 2-D: one batch of 37 rows
    _spec("B1_T40_H2_V128_eps1e-5", shape=(1, 40, 256), v=128, eps=1e-5),
    _spec("bf16_B2_T33_H4_V128", shape=(2, 33, 512), v=128, dtype=jnp.bfloat16),
    _spec("bf16_x_f32_weight_V256", shape=(1, 20, 512), v=256, dtype=jnp.bfloat16,
          weight_dtype=jnp.float32),
    _spec("heads_axis_B2_T5_H2_V32", shape=(2, 5, 2, 32)),   # [B, T, H, V], one group
    _spec("vector_V8", shape=(8,)),
    _spec("empty_T0", shape=(2, 0, 32), v=16),
    # The GatedDeltaNet layer's output norm: qwen3.5-tiny / Qwen3-Next heads.
    _spec("qwen3_5_B1_T4096_H32_V128", shape=(1, 4096, 4096), v=128, dtype=jnp.bfloat16,
          tags=("aot", "qwen3_5", "qwen3_next")),
]
