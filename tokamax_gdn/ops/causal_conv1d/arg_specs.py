"""Named causal-conv1d workloads: conformance cases and Qwen3-Next/3.5 shapes.

One list, three users: the conformance suite ('conformance', and
'interpret' for the ones small enough for Pallas interpret mode), the
benchmark ('bench') and AOT compiles / autotuning ('aot', model tags). The
model shapes are the GatedDeltaNet conv: D = 2*Hk*K + Hv*V channels, W = 4.
"""

import jax
import jax.numpy as jnp

from tokamax_gdn.autotuning import ArgSpec

DIFF = ("x", "weight", "bias", "initial_state")


def random_inputs(
    key: jax.Array,
    *,
    b: int,
    t: int,
    d: int,
    w: int = 4,
    dtype=jnp.float32,
    bias: bool = True,
    initial_state: bool = True,
    segments: int = 0,
    activation: str | None = "silu",
):
  """Random conv inputs (never zeros) as (args, kwargs).

  Weights ~ U(-1/sqrt(W), 1/sqrt(W)) (PyTorch's Conv1d init); `segments` > 0
  packs about that many segments per row.
  """
  ks = jax.random.split(key, 5)
  x = jax.random.normal(ks[0], (b, t, d), jnp.float32).astype(dtype)
  bound = w**-0.5
  weight = jax.random.uniform(ks[1], (d, w), jnp.float32, -bound, bound).astype(dtype)
  args = (x, weight, jax.random.normal(ks[2], (d,), jnp.float32).astype(dtype) if bias else None)
  kwargs = dict(activation=activation)
  if initial_state:
    kwargs["initial_state"] = jax.random.normal(ks[3], (b, w - 1, d), jnp.float32).astype(dtype)
    kwargs["output_final_state"] = True
  if segments:
    cuts = jax.random.uniform(ks[4], (b, t)) < (segments - 1) / max(t, 1)
    kwargs["segment_ids"] = jnp.cumsum(cuts, axis=1).astype(jnp.int32)
  return args, kwargs


def _spec(name, *, tags=("conformance", "interpret"), **shape):
  return ArgSpec(name=name, make=lambda key: random_inputs(key, **shape),
                 diff_argnames=DIFF, tags=tags)


ARG_SPECS: list[ArgSpec] = [
    _spec("D16_T24_W4", b=2, t=24, d=16),
    _spec("D130_T37_W4_segments", b=2, t=37, d=130, segments=3),
    _spec("D8_T2_W4_short", b=1, t=2, d=8),                  # T < W-1: state spans x
    _spec("D24_T20_W2_nobias_nostate", b=1, t=20, d=24, w=2, bias=False, initial_state=False),
    _spec("D32_T33_W3_identity", b=1, t=33, d=32, w=3, activation=None, segments=2),
    _spec("bf16_D256_T64", b=1, t=64, d=256, dtype=jnp.bfloat16, segments=2),
    # Empty shapes: correctly shaped empty results (and a final state from the
    # initial state alone when T = 0).
    _spec("empty_B0", b=0, t=8, d=16),
    _spec("empty_D0", b=2, t=8, d=0, segments=2),
    _spec("empty_T0", b=2, t=0, d=16),
    # Qwen3.5 shapes: D = 2*16*128 + 32*128 = 8192 (tiny / 35B-A3B / Qwen3-Next-80B).
    _spec("qwen3_5_D8192_T4096", b=1, t=4096, d=8192, dtype=jnp.bfloat16, bias=False,
          initial_state=False, tags=("bench", "aot", "qwen3_5", "qwen3_next")),
    _spec("qwen3_5_397b_D12288_T4096", b=1, t=4096, d=12288, dtype=jnp.bfloat16, bias=False,
          initial_state=False, tags=("bench", "qwen3_5")),
]
