"""Named gmm workloads: conformance cases and Qwen3.5-MoE expert shapes.

One list, three users: the conformance suite ('conformance'; 'interpret' for
the few also run through Pallas interpret mode there, the op's own pallas
tests cover the rest), the benchmark ('bench') and
AOT compiles / autotuning ('aot', 'qwen3_5').

Qwen3.5-MoE-like expert matmuls at 8192 routed tokens per device: hidden
2048, expert intermediate 512..1024, 8..128 local experts.
"""

import jax
import jax.numpy as jnp

from tokamax_gdn.autotuning import ArgSpec

DIFF = ("lhs", "rhs")


def random_group_sizes(key: jax.Array, *, g: int, total: int, empty: tuple[int, ...] = ()):
  """[G] int32 summing to `total`, uneven, with the groups in `empty` empty."""
  if g == 0:
    return jnp.zeros((0,), jnp.int32)
  logits = jax.random.normal(key, (g,))
  logits = logits.at[jnp.asarray(empty, jnp.int32)].set(-jnp.inf) if empty else logits
  ids = jax.random.categorical(key, logits, shape=(total,))
  return jnp.bincount(ids, length=g).astype(jnp.int32)


def random_lhs(key: jax.Array, m: int, k: int, dtype) -> jax.Array:
  """[M, K] normal rows; integer dtypes get int8-range values (x40, rounded)."""
  lhs = jax.random.normal(key, (m, k), jnp.float32)
  if jnp.issubdtype(dtype, jnp.integer):
    lhs = jnp.clip(jnp.round(lhs * 40), -127, 127)
  return lhs.astype(dtype)


def spec_maker(make_inputs):
  """`_spec(name, tags=..., **shape)` building ArgSpecs from `make_inputs(key, **shape)`."""
  def spec(name, *, tags=("conformance",), **shape):
    return ArgSpec(name=name, make=lambda key: make_inputs(key, **shape),
                   diff_argnames=DIFF, tags=tags, vmap_ok=False)
  return spec


def random_inputs(key: jax.Array, *, m: int, k: int, n: int, g: int, total: int | None = None,
                  empty: tuple[int, ...] = (), lhs_dtype=jnp.float32, rhs_dtype=None,
                  transpose_rhs: bool = False, preferred_element_type=None):
  """(args, kwargs) for gmm; `total` rows in groups (default M)."""
  k1, k2, k3 = jax.random.split(key, 3)
  rhs_dtype = rhs_dtype or lhs_dtype
  lhs = random_lhs(k1, m, k, lhs_dtype)
  rhs_shape = (g, n, k) if transpose_rhs else (g, k, n)
  rhs = (jax.random.normal(k2, rhs_shape, jnp.float32) * max(k, 1)**-0.5).astype(rhs_dtype)
  gs = random_group_sizes(k3, g=g, total=m if total is None else total, empty=empty)
  kwargs = {}
  if transpose_rhs:
    kwargs["transpose_rhs"] = True
  if preferred_element_type is not None:
    kwargs["preferred_element_type"] = preferred_element_type
  return (lhs, rhs, gs), kwargs


_spec = spec_maker(random_inputs)


_SMALL = ("conformance", "interpret")
_QWEN = ("aot", "bench", "qwen3_5")
_BF16 = dict(lhs_dtype=jnp.bfloat16)

# (name, tags, shape) of the workloads gmm and tgmm share: tgmm's arg_specs
# builds its own inputs (rhs [M, N]) for the same shapes.
SHARED_SHAPES: list[tuple[str, tuple[str, ...], dict]] = [
    ("f32_M64_K48_N40_G4_sum50_empty1", _SMALL, dict(m=64, k=48, n=40, g=4, total=50, empty=(1,))),
    ("bf16_M96_K128_N136_G5_empty03", ("conformance",),
     dict(m=96, k=128, n=136, g=5, empty=(0, 3), **_BF16)),
    ("f32_one_group_M32_K16_N16_G3", ("conformance",), dict(m=32, k=16, n=16, g=3, empty=(0, 2))),
    ("bf16_x_f32_M48_K64_N32_G4", _SMALL,
     dict(m=48, k=64, n=32, g=4, empty=(2,), lhs_dtype=jnp.bfloat16, rhs_dtype=jnp.float32)),
    ("int8_x_bf16_M64_K32_N48_G3", _SMALL,
     dict(m=64, k=32, n=48, g=3, total=60, lhs_dtype=jnp.int8, rhs_dtype=jnp.bfloat16)),
    ("f32_G1_M40_K24_N24_sum33", ("conformance",), dict(m=40, k=24, n=24, g=1, total=33)),
    ("f32_M200_K136_N72_G16_sum170", ("conformance",),
     dict(m=200, k=136, n=72, g=16, total=170, empty=(0, 5, 15))),
    # Empty shapes: every implementation returns zeros of the right shape.
    ("f32_empty_M0_K16_N8_G3", _SMALL, dict(m=0, k=16, n=8, g=3)),
    ("f32_empty_K0_M12_N8_G3", _SMALL, dict(m=12, k=0, n=8, g=3)),
    ("f32_empty_N0_M12_K16_G3", _SMALL, dict(m=12, k=16, n=0, g=3)),
    ("f32_empty_G0_M12_K16_N8", _SMALL, dict(m=12, k=16, n=8, g=0, total=0)),
    # Qwen3.5-MoE expert gate/up shapes at 8192 routed tokens (K=2048 -> N).
    ("qwen3_5_gate_M8192_K2048_N1024_G8", _QWEN, dict(m=8192, k=2048, n=1024, g=8, **_BF16)),
    ("qwen3_5_gate_M8192_K2048_N512_G128", _QWEN, dict(m=8192, k=2048, n=512, g=128, **_BF16)),
]

ARG_SPECS: list[ArgSpec] = [_spec(name, tags=tags, **shape) for name, tags, shape in SHARED_SHAPES]
ARG_SPECS += [
    _spec("f32_transposed_M50_K40_N24_G3_sum45", tags=_SMALL, m=50, k=40, n=24, g=3, total=45,
          transpose_rhs=True),
    # The expert down projection (K -> 2048), and more experts per device.
    _spec("qwen3_5_down_M8192_K512_N2048_G128", tags=_QWEN, m=8192, k=512, n=2048, g=128,
          **_BF16),
    _spec("qwen3_5_gate_M8192_K2048_N1024_G32", tags=("bench", "qwen3_5"),
          m=8192, k=2048, n=1024, g=32, **_BF16),
]
