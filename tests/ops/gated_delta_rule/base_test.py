"""Argument checks shared by every GDN implementation (they run in `bind`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs
from tokamax_gdn.testing import conformance


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


# ------------------------------------------------------- per-segment states
def _segment_states(n=3):
  args, kwargs = _inputs()
  s = kwargs["initial_state"]
  kwargs["initial_state"] = jnp.stack([s * (i + 1) for i in range(n)], axis=1)
  kwargs["segment_ids"] = jnp.array([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5]], jnp.int32)
  return args, kwargs


@pytest.mark.parametrize("impl", list(registry.implementations("gated_delta_rule")))
def test_per_segment_state_needs_segment_ids_and_one_state(impl):
  args, kwargs = _segment_states()
  with pytest.raises(ValueError, match="`initial_state`.*needs `segment_ids`"):
    tokamax_gdn.gated_delta_rule(*args, **{**kwargs, "segment_ids": None},
                                 implementation=impl)
  with pytest.raises(ValueError, match="`initial_state`.*at least 1"):
    tokamax_gdn.gated_delta_rule(
        *args, **{**kwargs, "initial_state": kwargs["initial_state"][:, :0]},
        implementation=impl)
  with pytest.raises(ValueError, match="`initial_state`.*N, Hv, K, V"):
    tokamax_gdn.gated_delta_rule(
        *args, **{**kwargs, "initial_state": kwargs["initial_state"][..., :3]},
        implementation=impl)


def test_per_segment_state_unsupported_raises_not_implemented_and_falls_back():
  class NoSegmentStates(registry.get("gated_delta_rule", "reference").__class__):
    supports_segment_states = False

  args, kwargs = _segment_states()
  with pytest.raises(NotImplementedError, match="per-segment states"):
    NoSegmentStates()(*args, **kwargs)
  out, final = tokamax_gdn.gated_delta_rule(
      *args, **kwargs, implementation=[NoSegmentStates(), "reference"])
  assert out.shape == (2, 6, 4, 4) and final.shape == (2, 3, 4, 8, 4)


# ------------------------------------------------------------- float64, jvp
@pytest.mark.parametrize("impl", list(registry.implementations("gated_delta_rule")))
def test_float64_inputs_run_in_float32(impl):
  """float64 in: out float64, state float32, and the same numbers (forward and
  gradients) as the float32 inputs give: every implementation computes in
  float32."""
  with jax.enable_x64(True):
    (q, k, v, g, beta), kw = random_inputs(jax.random.key(2), b=1, t=9, hk=1, hv=2, dk=8,
                                           dv=8, dtype=jnp.float64)
    kw["initial_state"] = kw["initial_state"].astype(jnp.float64)

    def run(args, s0):
      def loss(args, s0):
        out, final = tokamax_gdn.gated_delta_rule(
            *args, **{**kw, "initial_state": s0}, implementation=impl)
        return jnp.sum(out * out) + jnp.sum(final), (out, final)
      with conformance.execution_context(impl):
        return jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(args, s0)

    grads64, (out64, final64) = run((q, k, v, g, beta), kw["initial_state"])
    f32 = lambda x: x.astype(jnp.float32)
    grads32, (out32, final32) = run(tuple(map(f32, (q, k, v, g, beta))), f32(kw["initial_state"]))
  assert out64.dtype == jnp.float64 and final64.dtype == jnp.float32
  np.testing.assert_array_equal(out64, np.asarray(out32, np.float64))
  np.testing.assert_array_equal(final64, final32)
  for a, b in zip(jax.tree.leaves(grads64), jax.tree.leaves(grads32)):
    assert a.dtype == jnp.float64
    np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("impl", list(registry.implementations("gated_delta_rule")))
def test_forward_mode_autodiff_raises_a_clear_error(impl):
  args, kwargs = _inputs()
  f = lambda q: tokamax_gdn.gated_delta_rule(q, *args[1:], **kwargs, implementation=impl)[0]
  with conformance.execution_context(impl):
    for forward_mode in (lambda q: jax.jvp(f, (q,), (q,)), jax.jacfwd(f),
                         jax.jit(lambda q: jax.jvp(f, (q,), (q,)))):
      with pytest.raises(TypeError, match="gated_delta_rule does not support forward-mode"):
        forward_mode(args[0])
    # Reverse mode, what it supports, every gradient test runs (here it cost
    # the interpret-mode Pallas kernels 10 CPU-s of the CI budget).
