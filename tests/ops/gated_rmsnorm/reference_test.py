"""The gated RMSNorm's reference against a float64 loop over rows and groups
(forward) and against finite differences (gradients)."""

import jax
from jax import test_util as jtu
import jax.numpy as jnp
import numpy as np

from tokamax_gdn import gated_rmsnorm
from tokamax_gdn.ops.gated_rmsnorm import arg_specs


def _loop(x, gate, weight, eps):
  """Row by row, group by group, in float64 (no casts: float32 inputs)."""
  x, gate, weight = (np.asarray(a, np.float64) for a in (x, gate, weight))
  v = weight.shape[0]
  y = np.empty_like(x)
  for idx in np.ndindex(*x.shape[:-1]):
    for h in range(x.shape[-1] // v):
      cols = slice(h * v, (h + 1) * v)
      xg, gg = x[idx][cols], gate[idx][cols]
      n = xg / np.sqrt(np.mean(xg * xg) + eps)
      y[idx + (cols,)] = weight * n * gg / (1.0 + np.exp(-gg))
  return y


def test_forward_matches_the_loop():
  (x, gate, weight), kw = arg_specs.random_inputs(jax.random.key(0), shape=(2, 3, 24), v=8,
                                                  eps=1e-5)
  y = gated_rmsnorm(x, gate, weight, implementation="reference", **kw)
  np.testing.assert_allclose(y, _loop(x, gate, weight, 1e-5), rtol=2e-6, atol=2e-6)


def test_gradients_match_finite_differences():
  (x, gate, weight), kw = arg_specs.random_inputs(jax.random.key(1), shape=(3, 16), v=8)
  f = lambda x, g, w: gated_rmsnorm(x, g, w, implementation="reference", **kw)
  jtu.check_grads(f, (x, gate, weight), order=1, modes=["rev"], eps=1e-3, atol=2e-2, rtol=2e-2)


def test_weight_of_the_whole_axis_is_one_group_and_casts_follow_hf():
  """bf16 x: n is rounded to bf16 before the weight (HF's cast), y is bf16."""
  (x, gate, weight), kw = arg_specs.random_inputs(jax.random.key(2), shape=(4, 32),
                                                  dtype=jnp.bfloat16)
  y = gated_rmsnorm(x, gate, weight, implementation="reference", **kw)
  x32 = x.astype(jnp.float32)
  n = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)
  want = ((weight * n).astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32)))
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(y, want.astype(jnp.bfloat16))
