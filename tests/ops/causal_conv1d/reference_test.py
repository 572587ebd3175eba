"""The reference causal_conv1d against the float64 NumPy loop."""

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d import api

from .test_base import ConvTestBase, numpy_conv  # pylint: disable=relative-beyond-top-level


class TestReference(ConvTestBase):
  IMPL = "reference"
  # The VJP check compares an implementation with the reference: here it
  # would compare the reference with itself (its forward is checked against
  # the NumPy loop; its gradients are what the other implementations match).
  test_vjp_vs_reference = None


def test_registered():
  assert "reference" in registry.implementations("causal_conv1d")


def test_matches_hf_conv_no_state():
  """Zero initial state == no initial state (HF / causal-conv1d padding)."""
  x = jax.random.normal(jax.random.key(0), (2, 5, 4))
  w = jax.random.normal(jax.random.key(1), (4, 4))
  y0, f0 = api.causal_conv1d(x, w, implementation="reference", output_final_state=True)
  y1, f1 = api.causal_conv1d(x, w, implementation="reference", output_final_state=True,
                             initial_state=jnp.zeros((2, 3, 4)))
  np.testing.assert_array_equal(y0, y1)
  np.testing.assert_array_equal(f0, f1)
  np.testing.assert_allclose(y0, numpy_conv(x, w)[0], rtol=1e-5, atol=1e-6)
