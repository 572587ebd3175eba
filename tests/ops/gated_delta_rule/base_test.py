"""Argument checks shared by every GDN implementation (they run in `bind`)."""

import jax
import jax.numpy as jnp
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs


def _inputs():
  return random_inputs(jax.random.key(0), b=2, t=6, hk=2, hv=4, dk=8, dv=4)


def _replace(args, kwargs, **changes):
  names = ("query", "key", "value", "g", "beta")
  args = tuple(changes.pop(n, a) for n, a in zip(names, args))
  return args, {**kwargs, **changes}


BAD = [
    # (argument named in the message, error type, changes)
    ("query", ValueError, dict(query=jnp.ones((2, 6, 2)))),
    ("key", ValueError, dict(key=jnp.ones((2, 6, 2, 4)))),
    ("key", ValueError, dict(key=jnp.ones((2, 5, 2, 8)))),
    ("value", ValueError, dict(value=jnp.ones((3, 6, 4, 4)))),
    ("value", ValueError, dict(value=jnp.ones((2, 6, 3, 4)))),   # Hv % Hk != 0
    ("g", ValueError, dict(g=jnp.ones((2, 6, 2)))),
    ("g", ValueError, dict(g=jnp.ones((2, 6, 4, 1)))),
    ("beta", ValueError, dict(beta=jnp.ones((2, 7, 4)))),
    ("initial_state", ValueError, dict(initial_state=jnp.ones((2, 4, 4, 8)))),
    ("a_log", ValueError, dict(a_log=jnp.ones((2,)), dt_bias=jnp.ones((4,)))),
    ("dt_bias", ValueError, dict(a_log=jnp.ones((4,)), dt_bias=jnp.ones((3,)))),
    ("dt_bias", ValueError, dict(a_log=None, dt_bias=jnp.ones((4,)))),
    ("segment_ids", ValueError, dict(segment_ids=jnp.ones((2, 5), jnp.int32))),
    ("segment_ids", TypeError, dict(segment_ids=jnp.ones((2, 6), jnp.float32))),
    ("query", TypeError, dict(query=jnp.ones((2, 6, 2, 8), jnp.int32))),
    ("value", TypeError, dict(value=jnp.ones((2, 6, 4, 4), jnp.int8))),
    ("beta", TypeError, dict(beta=jnp.ones((2, 6, 4), jnp.int32))),
    ("initial_state", TypeError, dict(initial_state=jnp.ones((2, 4, 8, 4), jnp.int32))),
]


@pytest.mark.parametrize("impl", list(registry.implementations("gated_delta_rule")))
@pytest.mark.parametrize("name,err,changes", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_inputs_name_the_argument(impl, name, err, changes):
  args, kwargs = _replace(*_inputs(), **changes)
  with pytest.raises(err, match=f"`{name}`"):
    tokamax_gdn.gated_delta_rule(*args, **kwargs, implementation=impl)


def test_head_dim_limit_raises_not_implemented_and_falls_back():
  class Limited(registry.get("gated_delta_rule", "reference").__class__):
    max_head_dim = 4

  args, kwargs = _inputs()
  with pytest.raises(NotImplementedError, match="K=8"):
    Limited()(*args, **kwargs)
  out, _ = tokamax_gdn.gated_delta_rule(*args, **kwargs,
                                        implementation=[Limited(), "reference"])
  assert out.shape == (2, 6, 4, 4)


def test_scale_defaults_to_inverse_sqrt_k():
  args, kwargs = _inputs()
  ba = registry.get("gated_delta_rule", "reference").bind(*args, **kwargs)
  assert ba.arguments["scale"] == pytest.approx(8**-0.5)


def test_prologue_gate_and_l2norm():
  x = jnp.array([[3.0, 4.0]])
  assert jnp.allclose(base.l2norm(x), x / jnp.sqrt(25.0 + 1e-6))
  g = jnp.array([0.5]); a_log = jnp.array([0.2]); dt = jnp.array([-1.0])
  expected = -jnp.exp(0.2) * jax.nn.softplus(-0.5)
  assert jnp.allclose(base.gate_log_decay(g, a_log, dt), expected)
