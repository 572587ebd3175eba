"""Named gated-delta-rule workloads: conformance cases and Qwen3-Next/3.5 shapes.

One list, three users: the conformance suite ('conformance'), the benchmark
('bench') and AOT compiles / autotuning ('aot', model tags).
"""

import jax
import jax.numpy as jnp

from tokamax_gdn.autotuning import ArgSpec

DIFF = ("query", "key", "value", "g", "beta", "initial_state", "a_log", "dt_bias")


def random_inputs(
    key: jax.Array,
    *,
    b: int,
    t: int,
    hk: int,
    hv: int,
    dk: int,
    dv: int,
    dtype=jnp.float32,
    gate: bool = False,
    initial_state: bool = True,
    segments: int = 0,
    unit_keys: bool = False,
    beta_logits: bool = False,
):
  """Realistic random GDN inputs (never zeros) as (args, kwargs).

  Keys are scaled so |beta k^T k| stays O(1) as in trained models (exactly
  unit keys with `unit_keys`); the log decay is -softplus(normal) / 2 (or the
  raw gate with `a_log`/`dt_bias` when `gate`); beta is sigmoid(normal), or
  with `beta_logits` 2 * normal and `use_beta_sigmoid`; `segments` > 0 packs
  about that many random-length segments per row.
  """
  ks = jax.random.split(key, 9)
  normal = lambda k, s: jax.random.normal(k, s, jnp.float32)
  q = normal(ks[0], (b, t, hk, dk)).astype(dtype)
  k = normal(ks[1], (b, t, hk, dk))
  if unit_keys:
    k = k * jax.lax.rsqrt(jnp.sum(k * k, axis=-1, keepdims=True))
  else:
    k = k * dk**-0.5
  k = k.astype(dtype)
  v = normal(ks[2], (b, t, hv, dv)).astype(dtype)
  if beta_logits:
    beta = (2.0 * normal(ks[3], (b, t, hv))).astype(dtype)
    kwargs = dict(use_beta_sigmoid=True)
  else:
    beta = jax.nn.sigmoid(normal(ks[3], (b, t, hv))).astype(dtype)
    kwargs = {}
  if gate:
    g = normal(ks[4], (b, t, hv)).astype(dtype)
    kwargs["a_log"] = jnp.log(jax.random.uniform(ks[5], (hv,), jnp.float32, 1.0, 16.0))
    kwargs["dt_bias"] = normal(ks[6], (hv,))
  else:
    g = (-jax.nn.softplus(normal(ks[4], (b, t, hv))) * 0.5).astype(dtype)
  if initial_state:
    kwargs["initial_state"] = normal(ks[7], (b, hv, dk, dv)) * 0.1
    kwargs["output_final_state"] = True
  if segments:
    cuts = jax.random.uniform(ks[8], (b, t)) < (segments - 1) / max(t, 1)
    kwargs["segment_ids"] = jnp.cumsum(cuts, axis=1).astype(jnp.int32)
  return (q, k, v, g, beta), kwargs


def _spec(name, *, tags=("conformance",), vmap_ok=True, **shape):
  return ArgSpec(
      name=name,
      make=lambda key: random_inputs(key, **shape),
      diff_argnames=DIFF,
      tags=tags,
      vmap_ok=vmap_ok,
  )


def _with(args_kwargs, **extra):
  args, kwargs = args_kwargs
  return args, {**kwargs, **extra}


ARG_SPECS: list[ArgSpec] = [
    _spec("mha_T24", b=2, t=24, hk=2, hv=2, dk=16, dv=16,
          tags=("conformance", "interpret")),
    _spec("gva_1to2_T40_gate", b=1, t=40, hk=1, hv=2, dk=16, dv=32, gate=True),
    _spec("gva_1to4_T70_segments", b=2, t=70, hk=1, hv=4, dk=32, dv=16, segments=3,
          initial_state=True),
    # The layer's whole prologue: L2 norm, gate activation, beta's sigmoid.
    ArgSpec(
        name="l2norm_gate_sigmoid_T33",
        make=lambda key: _with(
            random_inputs(key, b=1, t=33, hk=2, hv=4, dk=16, dv=16, gate=True,
                          beta_logits=True),
            use_qk_l2norm=True),
        diff_argnames=DIFF,
        tags=("conformance", "interpret"),
    ),
    ArgSpec(
        name="bf16_T48",
        make=lambda key: random_inputs(key, b=1, t=48, hk=1, hv=2, dk=32, dv=32,
                                       dtype=jnp.bfloat16),
        diff_argnames=DIFF,
    ),
    # Empty shapes: correctly shaped empty results (the state passes through
    # T = 0; B = 0 has none), zero gradients, for every implementation.
    _spec("empty_B0", b=0, t=20, hk=1, hv=2, dk=8, dv=8, segments=2,
          tags=("conformance", "interpret", "empty")),
    _spec("empty_T0", b=2, t=0, hk=1, hv=2, dk=8, dv=8,
          tags=("conformance", "interpret", "empty")),
    # Qwen3-Next / Qwen3.5 per-device shapes (K = V = 128).
    _spec("qwen3_5_tiny_T4096", b=1, t=4096, hk=16, hv=32, dk=128, dv=128,
          dtype=jnp.bfloat16, gate=True, tags=("aot", "qwen3_5")),
    _spec("bench_T2048", b=1, t=2048, hk=2, hv=4, dk=128, dv=128, tags=("bench",)),
    _spec("bench_T8192", b=1, t=8192, hk=2, hv=4, dk=128, dv=128, tags=("bench",)),
]
