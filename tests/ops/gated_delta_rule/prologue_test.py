"""The GDN prologue (`ops/gated_delta_rule/prologue.py`)."""

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.gated_delta_rule import prologue


def test_prologue_gate_and_l2norm():
  x = jnp.array([[3.0, 4.0]])
  assert jnp.allclose(prologue.l2norm(x), x / jnp.sqrt(25.0 + 1e-6))
  g = jnp.array([0.5]); a_log = jnp.array([0.2]); dt = jnp.array([-1.0])
  expected = -jnp.exp(0.2) * jax.nn.softplus(-0.5)
  assert jnp.allclose(prologue.gate_log_decay(g, a_log, dt), expected)
