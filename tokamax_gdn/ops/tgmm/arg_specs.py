"""Named tgmm workloads: gmm's shared shapes (`gmm.arg_specs.SHARED_SHAPES`).

Tags as in `tokamax_gdn.ops.gmm.arg_specs`. tgmm(x [M, K], dy [M, N]) is the
expert weight gradient [G, K, N] of gmm(x, w [G, K, N]), so the same
conformance cases and Qwen3.5-MoE expert shapes serve both.
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

ARG_SPECS: list[ArgSpec] = [
    _spec(name, tags=tags, **shape) for name, tags, shape in gmm_specs.SHARED_SHAPES]
