"""The xla causal_conv1d against the NumPy loop and the reference (forward + VJP)."""

import os

# Other processes on the machine may hold libtpu (AOT compiles); share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import aot
from tokamax_gdn.ops.causal_conv1d import api

from .test_base import ConvTestBase  # pylint: disable=relative-beyond-top-level


class TestXla(ConvTestBase):
  IMPL = "xla"


def test_jit_and_vmap():
  x = jax.random.normal(jax.random.key(0), (3, 2, 11, 8))
  w = jax.random.normal(jax.random.key(1), (8, 4))
  f = jax.jit(jax.vmap(lambda x: api.causal_conv1d(x, w, implementation="xla")[0]))
  ref = jnp.stack([api.causal_conv1d(xi, w, implementation="reference")[0] for xi in x])
  np.testing.assert_allclose(f(x), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.aot
def test_aot_qwen_shape(target="tpu7x"):
  """D=8192, T=4096 bf16 forward + backward compiles for the chip (XLA path;
  one generation: the Pallas test compiles for two)."""
  def loss(x, w):
    y, _ = api.causal_conv1d(x, w, implementation="xla")
    return jnp.sum(y.astype(jnp.float32))

  rep = aot.compile_for(target, jax.value_and_grad(loss, argnums=(0, 1)),
                        ((1, 4096, 8192), jnp.bfloat16), ((8192, 4), jnp.bfloat16))
  assert rep.temp_bytes < 1 << 30
