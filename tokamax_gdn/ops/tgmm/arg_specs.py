"""Named tgmm workloads: conformance cases and Qwen3.5-MoE weight-gradient shapes.

Tags as in `tokamax_gdn.ops.gmm.arg_specs`. tgmm(x [M, K], dy [M, N]) is the
expert weight gradient [G, K, N] of gmm(x, w [G, K, N]).
"""

import jax
import jax.numpy as jnp

from tokamax_gdn.autotuning import ArgSpec
from tokamax_gdn.ops.gmm import arg_specs as gmm_specs

DIFF = gmm_specs.DIFF


def random_inputs(key: jax.Array, *, m: int, k: int, n: int, g: int, total: int | None = None,
                  empty: tuple[int, ...] = (), lhs_dtype=jnp.float32, rhs_dtype=None):
  """(args, kwargs) for tgmm; `total` rows in groups (default M)."""
  k1, k2, k3 = jax.random.split(key, 3)
  rhs_dtype = rhs_dtype or lhs_dtype
  lhs = gmm_specs.random_lhs(k1, m, k, lhs_dtype)
  rhs = jax.random.normal(k2, (m, n), jnp.float32).astype(rhs_dtype)
  gs = gmm_specs.random_group_sizes(k3, g=g, total=m if total is None else total, empty=empty)
  return (lhs, rhs, gs), {}


_spec = gmm_specs.spec_maker(random_inputs)


_SMALL = ("conformance", "interpret")

ARG_SPECS: list[ArgSpec] = [
    _spec("f32_M64_K48_N40_G4_sum50_empty1", tags=_SMALL, m=64, k=48, n=40, g=4, total=50,
          empty=(1,)),
    _spec("bf16_M96_K128_N136_G5_empty03", m=96, k=128, n=136, g=5, empty=(0, 3),
          lhs_dtype=jnp.bfloat16),
    _spec("f32_one_group_M32_K16_N16_G3", m=32, k=16, n=16, g=3, empty=(0, 2)),
    _spec("bf16_x_f32_M48_K64_N32_G4", tags=_SMALL, m=48, k=64, n=32, g=4, empty=(2,),
          lhs_dtype=jnp.bfloat16, rhs_dtype=jnp.float32),
    _spec("int8_x_bf16_M64_K32_N48_G3", m=64, k=32, n=48, g=3, total=60,
          lhs_dtype=jnp.int8, rhs_dtype=jnp.bfloat16),
    _spec("f32_M200_K136_N72_G16_sum170", m=200, k=136, n=72, g=16, total=170, empty=(0, 5, 15)),
    _spec("qwen3_5_dw_gate_M8192_K2048_N1024_G8", tags=("aot", "bench", "qwen3_5"),
          m=8192, k=2048, n=1024, g=8, lhs_dtype=jnp.bfloat16),
    _spec("qwen3_5_dw_gate_M8192_K2048_N512_G128", tags=("aot", "bench", "qwen3_5"),
          m=8192, k=2048, n=512, g=128, lhs_dtype=jnp.bfloat16),
]
