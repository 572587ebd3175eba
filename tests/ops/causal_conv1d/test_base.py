"""Shared checks for every causal_conv1d implementation (mixed into each backend's test).

The oracle is a float64 NumPy loop written from the definition, independent of
`base.window_reach`: for each token walk back through the window and stop at a
segment change.
"""

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn.ops.causal_conv1d import api
from tokamax_gdn.ops.causal_conv1d import arg_specs
from tokamax_gdn.testing.specs import rel_rms, tolerance


def numpy_conv(x, weight, bias=None, *, activation="silu", initial_state=None,
               output_final_state=False, segment_ids=None):
  """float64 loop: y[t] = act(bias + sum_s weight[:, W-1-s] * input(t - s))."""
  x = np.asarray(x, np.float64)
  weight = np.asarray(weight, np.float64)
  b, t, d = x.shape
  w = weight.shape[1]
  state = (np.zeros((b, w - 1, d)) if initial_state is None
           else np.asarray(initial_state, np.float64))
  seg = np.zeros((b, t), np.int64) if segment_ids is None else np.asarray(segment_ids)
  y = np.zeros((b, t, d))
  for bi in range(b):
    for ti in range(t):
      acc = np.zeros(d) if bias is None else np.asarray(bias, np.float64).copy()
      for s in range(w):
        src = ti - s
        if src >= 0:
          if any(seg[bi, u] != seg[bi, u - 1] for u in range(src + 1, ti + 1)):
            break
          acc += weight[:, w - 1 - s] * x[bi, src]
        else:
          if any(seg[bi, u] != seg[bi, u - 1] for u in range(1, ti + 1)):
            break
          acc += weight[:, w - 1 - s] * state[bi, w - 1 + src]
      y[bi, ti] = acc / (1 + np.exp(-acc)) if activation == "silu" else acc
  if not output_final_state:
    return y, None
  full = np.concatenate([state, x], axis=1)
  fs = full[:, t:].copy()
  for bi in range(b):
    last = t - 1
    for j in range(w - 1):
      src = t - (w - 1) + j
      lo = max(src + 1, 1)
      if any(seg[bi, u] != seg[bi, u - 1] for u in range(lo, last + 1)) if t else False:
        fs[bi, j] = 0.0
  return y, fs


def _tol(dtype, grad=False):
  return tolerance(dtype, grad=grad)


def check_nan_isolation(call, context=contextlib.nullcontext):
  """A NaN and an inf in segment 1's inputs and cotangents reach nothing of
  segments 0 and 2: outputs, the final state (segment 2 ends the row), the
  initial state's gradient (segment 0 starts it) and their inputs' gradients
  equal a run with finite values there. (The weight and bias gradients sum
  over every token, segment 1's included.)

  `call(x, weight, bias, **kwargs)` is the implementation under test, run
  (forward and backward) under `context()`.
  """
  args, kwargs = arg_specs.random_inputs(jax.random.key(7), b=2, t=40, d=16, w=4)
  x, weight, bias = args
  seg = jnp.asarray(np.repeat([[0, 1, 2]], 2, axis=0).repeat([13, 14, 13], axis=1), jnp.int32)
  kwargs.update(segment_ids=seg, output_final_state=True)
  s0 = kwargs.pop("initial_state")
  ct_y = jax.random.normal(jax.random.key(8), x.shape)
  ct_s = jax.random.normal(jax.random.key(9), s0.shape)
  bad = (slice(None), slice(13, 27))

  @jax.jit   # one compile for both runs (eager dispatch compiles every primitive)
  def run(x, ct_y):
    with context():
      out, vjp = jax.vjp(lambda x, s0: call(x, weight, bias, initial_state=s0, **kwargs), x, s0)
      return out, vjp((ct_y, ct_s))

  clean = run(x, ct_y)
  poisoned = run(x.at[:, 15, 3].set(jnp.nan).at[:, 20, 5].set(jnp.inf),
                 ct_y.at[:, 17, 1].set(jnp.nan))
  (y, fs), (dx, ds0) = clean
  (y_p, fs_p), (dx_p, ds0_p) = poisoned
  assert np.isnan(np.asarray(y_p)[bad]).any()       # the poison is there...
  keep = np.ones(x.shape[1], bool)
  keep[13:27] = False
  for name, a, b in (("y", y, y_p), ("dx", dx, dx_p)):   # ...and only there
    np.testing.assert_array_equal(np.asarray(b)[:, keep], np.asarray(a)[:, keep], err_msg=name)
  np.testing.assert_array_equal(fs_p, fs, err_msg="final state")
  np.testing.assert_array_equal(ds0_p, ds0, err_msg="initial state gradient")


@functools.cache
def _jitted(impl, static):
  """causal_conv1d(*args, **arrays, **static) under jit, one per (impl, static
  keywords): a compile per shape, reused by every call of the tests (eager
  dispatch compiles each primitive on its own: most of these tests' time)."""
  return jax.jit(lambda args, arrays: api.causal_conv1d(*args, implementation=impl, **arrays,
                                                         **dict(static)))


def fwd_and_vjp(f, primals, cotangent):
  """f(*primals) and its VJP of `cotangent`, in one jitted program."""
  out, vjp = jax.vjp(f, *primals)
  return out, vjp(cotangent)


_CONFORMANCE_SPECS = [s.name for s in arg_specs.ARG_SPECS if "conformance" in s.tags]


class ConvTestBase:
  """Subclasses set IMPL (an implementation name) and may override `context`."""

  IMPL = "reference"
  SPEC_TAG = "conformance"
  CUTS = (1, 2, 7)     # split points for the state-continuation test

  def context(self):
    import contextlib  # pylint: disable=g-import-not-at-top
    return contextlib.nullcontext()

  def call(self, *args, **kwargs):
    """The op under jit (`_jitted`): arrays traced, other keywords static."""
    arrays = {k: v for k, v in kwargs.items() if hasattr(v, "shape")}
    static = tuple(sorted((k, v) for k, v in kwargs.items() if k not in arrays))
    with self.context():
      return _jitted(self.IMPL, static)(args, arrays)

  def spec(self, name: str):
    """The conformance spec `name`; skipped unless also tagged SPEC_TAG."""
    spec = next(s for s in arg_specs.ARG_SPECS if s.name == name)
    if self.SPEC_TAG not in spec.tags:
      pytest.skip(f"spec {name} not tagged {self.SPEC_TAG!r}")
    return spec

  @pytest.mark.parametrize("name", _CONFORMANCE_SPECS)
  def test_forward_vs_numpy(self, name):
    args, kwargs = self.spec(name).make(jax.random.key(0))
    y, fs = self.call(*args, **kwargs)
    y_np, fs_np = numpy_conv(*args, **kwargs)
    assert y.dtype == args[0].dtype and y.shape == args[0].shape
    assert rel_rms(y, y_np) < _tol(args[0].dtype)
    if kwargs.get("output_final_state"):
      assert fs.dtype == args[0].dtype
      np.testing.assert_allclose(np.asarray(fs, np.float32), fs_np, rtol=1e-6, atol=1e-6)

  @pytest.mark.parametrize("name", _CONFORMANCE_SPECS)
  def test_vjp_vs_reference(self, name):
    args, kwargs = self.spec(name).make(jax.random.key(1))
    x, weight, bias = args
    s0 = kwargs.pop("initial_state", None)

    def run(impl, x, weight, bias, s0):
      return api.causal_conv1d(x, weight, bias, implementation=impl,
                               **dict(kwargs, initial_state=s0))

    primals = (x, weight, bias, s0)
    shapes = jax.eval_shape(lambda *a: run("reference", *a), *primals)
    cot = jax.tree.map(lambda r: jax.random.normal(jax.random.key(2), r.shape).astype(r.dtype),
                       shapes)
    vjp_of = lambda impl: jax.jit(functools.partial(
        fwd_and_vjp, lambda *a: run(impl, *a)))(primals, cot)
    ref, ref_grads = vjp_of("reference")
    with self.context():   # the backward runs under it too (interpret mode)
      out, grads = vjp_of(self.IMPL)
    assert rel_rms(out[0], ref[0]) < _tol(x.dtype)
    for n, g, rg in zip(("x", "weight", "bias", "initial_state"), grads, ref_grads):
      if rg is None:
        continue
      assert g.dtype == rg.dtype, n
      assert rel_rms(g, rg) < _tol(x.dtype, grad=True), n

  def test_state_continuation(self):
    """Conv over [x1; x2] == conv x1, then conv x2 from x1's final state."""
    args, kwargs = arg_specs.random_inputs(jax.random.key(3), b=2, t=19, d=16, w=4)
    x, weight, bias = args
    s0 = kwargs["initial_state"]
    y, fs = self.call(x, weight, bias, initial_state=s0, output_final_state=True)
    for cut in self.CUTS:
      y1, f1 = self.call(x[:, :cut], weight, bias, initial_state=s0, output_final_state=True)
      y2, f2 = self.call(x[:, cut:], weight, bias, initial_state=f1, output_final_state=True)
      np.testing.assert_allclose(jnp.concatenate([y1, y2], 1), y, rtol=1e-5, atol=1e-5)
      np.testing.assert_allclose(f2, fs, rtol=0, atol=0)

  def test_token_by_token(self):
    args, kwargs = arg_specs.random_inputs(jax.random.key(4), b=1, t=6, d=8, w=4)
    x, weight, bias = args
    y, _ = self.call(x, weight, bias, initial_state=kwargs["initial_state"])
    state, ys = kwargs["initial_state"], []
    for i in range(x.shape[1]):
      yi, state = self.call(x[:, i:i + 1], weight, bias, initial_state=state,
                            output_final_state=True)
      ys.append(yi)
    np.testing.assert_allclose(jnp.concatenate(ys, 1), y, rtol=1e-5, atol=1e-5)

  def test_segments_do_not_leak(self):
    """Perturbing segment 1 (and the initial state) leaves segment 2 unchanged."""
    args, kwargs = arg_specs.random_inputs(jax.random.key(5), b=1, t=16, d=8, w=4)
    x, weight, bias = args
    seg = jnp.array([[0] * 6 + [1] * 10], jnp.int32)
    y, fs = self.call(x, weight, bias, initial_state=kwargs["initial_state"],
                      segment_ids=seg, output_final_state=True)
    x2 = x.at[:, :6].add(10.0)
    y2, fs2 = self.call(x2, weight, bias, initial_state=kwargs["initial_state"] + 5.0,
                        segment_ids=seg, output_final_state=True)
    np.testing.assert_array_equal(y[:, 6:], y2[:, 6:])
    np.testing.assert_array_equal(fs, fs2)
    assert not np.allclose(y[:, :6], y2[:, :6])
    # A segment of one token at the very end: its final state holds only itself.
    seg = jnp.array([[0] * 15 + [1]], jnp.int32)
    _, fs = self.call(x, weight, bias, segment_ids=seg, output_final_state=True)
    np.testing.assert_array_equal(fs[:, :2], 0.0)
    np.testing.assert_array_equal(fs[:, 2], x[:, 15])

  def test_nan_in_one_segment_stays_there(self):
    check_nan_isolation(self.call, self.context)

  def test_segment_ids_equal_to_previous_after_gap(self):
    """Reset by change, not by value: ids 0,1,0 are three segments."""
    args, _ = arg_specs.random_inputs(jax.random.key(6), b=1, t=9, d=8, w=4,
                                      initial_state=False)
    seg = jnp.array([[0, 0, 0, 1, 1, 1, 0, 0, 0]], jnp.int32)
    y, _ = self.call(*args, segment_ids=seg)
    y_np, _ = numpy_conv(*args, segment_ids=seg)
    assert rel_rms(y, y_np) < 2e-4

  def test_errors(self):
    x = jnp.zeros((1, 4, 8))
    with pytest.raises(ValueError, match="weight"):
      self.call(x, jnp.zeros((4, 8)))
    with pytest.raises(ValueError, match="bias"):
      self.call(x, jnp.zeros((8, 4)), jnp.zeros((4,)))
    with pytest.raises(ValueError, match="initial_state"):
      self.call(x, jnp.zeros((8, 4)), initial_state=jnp.zeros((1, 4, 8)))
    with pytest.raises(TypeError, match="segment_ids"):
      self.call(x, jnp.zeros((8, 4)), segment_ids=jnp.zeros((1, 4)))
    with pytest.raises(TypeError, match="x"):
      self.call(x.astype(jnp.int32), jnp.zeros((8, 4)))
    with pytest.raises(ValueError, match="activation"):
      self.call(x, jnp.zeros((8, 4)), activation="gelu")
