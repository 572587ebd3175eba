"""Tests for the chunked `xla` gated delta rule against the reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pydantic
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import xla
from tokamax_gdn.ops.gated_delta_rule import xla_chunked_kernel
from tokamax_gdn.testing.specs import rel_rms, tolerance

GRAD_NAMES = ("query", "key", "value", "g", "beta", "initial_state", "a_log",
              "dt_bias")


def make_inputs(seed, *, b=1, t=65, hk=1, hv=2, dk=16, dv=8, dtype=jnp.float32,
                gate_params=False, normalise_keys=True, segments=None):
  """Realistic random inputs: unit keys, beta = sigmoid(normal), g <= 0."""
  rng = np.random.default_rng(seed)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k = normal(b, t, hk, dk), normal(b, t, hk, dk)
  if normalise_keys:
    q = q / np.linalg.norm(q, axis=-1, keepdims=True)
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  v = normal(b, t, hv, dv)
  g_raw = normal(b, t, hv)
  beta = 1.0 / (1.0 + np.exp(-normal(b, t, hv)))
  s0 = jnp.asarray(0.3 * normal(b, hv, dk, dv))
  kw = dict(initial_state=s0, output_final_state=True)
  if gate_params:
    g = g_raw
    kw["a_log"] = jnp.asarray(0.5 * normal(hv))
    kw["dt_bias"] = jnp.asarray(0.5 * normal(hv))
  else:
    g = -np.logaddexp(0.0, g_raw)
  if segments is not None:
    kw["segment_ids"] = segments
  cast = lambda x: jnp.asarray(x, dtype)
  return (cast(q), cast(k), cast(v), cast(g), cast(beta)), kw


def run(impl, args, kw, *, use_qk_l2norm=False, cot_seed=99):
  """(out, final_state, grads by name) of a fixed random linear loss."""
  names = ("query", "key", "value", "g", "beta")
  diff = dict(zip(names, args))
  for n in ("initial_state", "a_log", "dt_bias"):
    if kw.get(n) is not None:
      diff[n] = kw[n]
  static = {n: x for n, x in kw.items() if n not in diff}

  def f(diff):
    p = dict(diff)
    pos = [p.pop(n) for n in names]
    return tokamax_gdn.gated_delta_rule(
        *pos, **p, **static, use_qk_l2norm=use_qk_l2norm,
        implementation=impl)

  out_shape = jax.eval_shape(f, diff)
  rng = np.random.default_rng(cot_seed)
  c_out = rng.standard_normal(out_shape[0].shape).astype(np.float32)
  c_fin = rng.standard_normal(out_shape[1].shape).astype(np.float32)

  @jax.jit
  def fwd_bwd(diff):
    (out, fin), vjp = jax.vjp(f, diff)
    (grads,) = vjp((jnp.asarray(c_out, out.dtype), jnp.asarray(c_fin)))
    return out, fin, grads

  return fwd_bwd(diff)


def assert_close(impl, args, kw, dtype=jnp.float32, **run_kw):
  out, fin, grads = run(impl, args, kw, **run_kw)
  r_out, r_fin, r_grads = run("reference", args, kw, **run_kw)
  errs = {"out": rel_rms(out, r_out), "final_state": rel_rms(fin, r_fin)}
  for name in r_grads:
    errs["d_" + name] = rel_rms(grads[name], r_grads[name])
  for name, e in errs.items():
    tol = tolerance(dtype, grad=name.startswith("d_"))
    assert np.isfinite(e) and e <= tol, (name, e, tol, errs)
  assert set(r_grads) == set(grads)
  return out, fin, grads


def xla_op(chunk_size, block_size=2048, vjp_block_size=None):
  """The xla Op with its forward (and VJP) config fixed."""
  op = registry.get("gated_delta_rule", "xla")
  vjp_cfg = xla.Config(chunk_size=chunk_size,
                       block_size=vjp_block_size or block_size)
  return op.replace(config=xla.Config(chunk_size=chunk_size, block_size=block_size),
                    vjp=op.vjp.replace(config=vjp_cfg))


@pytest.mark.parametrize(
    "hk,hv,t,chunk,l2norm,gate",
    [
        (1, 1, 1, 16, False, False),
        (2, 2, 63, 16, True, True),
        (1, 2, 64, 32, False, False),
        (1, 4, 65, 64, True, False),
        (2, 4, 65, 128, False, True),
        (1, 2, 1000, 64, True, True),
    ],
)
def test_matches_reference(hk, hv, t, chunk, l2norm, gate):
  args, kw = make_inputs(t + hv, t=t, hk=hk, hv=hv, gate_params=gate,
                         normalise_keys=not l2norm)
  if l2norm:  # unnormalised q/k with a spread of norms
    args = (args[0] * 3.0, args[1] * 0.7) + args[2:]
  assert_close(xla_op(chunk), args, kw, use_qk_l2norm=l2norm)


def test_default_config_and_public_api_under_jit_grad():
  args, kw = make_inputs(1, t=40, hk=1, hv=2)
  kw = dict(kw, output_final_state=False)

  @jax.jit
  def loss_grad(q, k, v, g, beta):
    def loss(q, k, v, g, beta):
      out, _ = tokamax_gdn.gated_delta_rule(q, k, v, g, beta, **kw,
                                            implementation="xla")
      return jnp.sum(out**2)
    return jax.grad(loss, argnums=range(5))(q, k, v, g, beta)

  grads = loss_grad(*args)
  ref = jax.jit(jax.grad(
      lambda *a: jnp.sum(tokamax_gdn.gated_delta_rule(
          *a, **kw, implementation="reference")[0] ** 2),
      argnums=range(5)))(*args)
  for a, r in zip(grads, ref):
    assert rel_rms(a, r) <= tolerance(jnp.float32, grad=True)


def _segments(t, bounds):
  ids = np.zeros((1, t), np.int32)
  for i, s in enumerate(bounds):
    ids[0, s:] = i + 1
  return jnp.asarray(ids)


def test_segment_resets():
  t = 100
  # Chunk 32: boundaries inside chunks, at a chunk start (64), a one-token
  # segment (37) and a boundary at t = 1.
  seg = _segments(t, [5, 37, 38, 64, 90])
  seg = jnp.concatenate([seg, _segments(t, [1, 50])], axis=0)
  args, kw = make_inputs(3, b=2, t=t, hk=1, hv=2, segments=seg)
  assert_close(xla_op(32), args, kw)


def test_segment_isolation():
  """Segment 2's inputs change neither segment 1's outputs nor its gradients."""
  t, cut = 80, 29
  seg = _segments(t, [cut])
  args, kw = make_inputs(4, t=t, hk=1, hv=2, segments=seg)
  kw = dict(kw, output_final_state=False)
  op = xla_op(16)
  later = (jnp.arange(t) >= cut)[None, :, None, None]
  noise = np.random.default_rng(5).standard_normal(args[2].shape)
  perturbed = (args[0] + later * 0.5, args[1] - later * 0.3,
               args[2] + later * noise,
               args[3] + later[..., 0] * -0.7, args[4] * (1.0 - later[..., 0] / 2))

  @jax.jit
  def first_segment(q, k, v, g, beta):
    def loss(q, k, v, g, beta):
      out, _ = tokamax_gdn.gated_delta_rule(q, k, v, g, beta, **kw,
                                            implementation=op)
      return jnp.sum(jnp.sin(out[:, :cut])), out
    return jax.grad(loss, argnums=range(5), has_aux=True)(q, k, v, g, beta)

  grads_a, out_a = first_segment(*args)
  grads_b, out_b = first_segment(*perturbed)
  np.testing.assert_allclose(out_a[:, :cut], out_b[:, :cut], rtol=1e-6, atol=1e-6)
  assert rel_rms(out_a[:, cut:], out_b[:, cut:]) > 0.1
  for ga, gb in zip(grads_a, grads_b):
    np.testing.assert_allclose(ga[:, :cut], gb[:, :cut], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(gb[:, cut:], 0.0, atol=1e-6)


def test_gates_exactly_zero_and_minus_80():
  """Row 0: g exactly 0 on half the tokens; row 1: g = -80 on 30% of them."""
  args, kw = make_inputs(6, b=2, t=70, hk=1, hv=2)
  rng = np.random.default_rng(7)
  g = np.array(args[3])
  g[0][rng.random(g[0].shape) < 0.5] = 0.0
  g[1][rng.random(g[1].shape) < 0.3] = -80.0
  assert (g[0] == 0).mean() > 0.4 and (g[1] == -80).mean() > 0.2
  args = args[:3] + (jnp.asarray(g),) + args[4:]
  assert_close(xla_op(32), args, kw)


def test_bf16_inputs():
  args, kw = make_inputs(10, t=65, hk=1, hv=2, dtype=jnp.bfloat16)
  out, fin, grads = assert_close(xla_op(32), args, kw, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16 and fin.dtype == jnp.float32
  assert grads["query"].dtype == jnp.bfloat16
  assert grads["initial_state"].dtype == jnp.float32


def test_long_sequence_alternating_gates_is_finite():
  t = 32768
  args, kw = make_inputs(11, t=t, hk=1, hv=1, dk=16, dv=16)
  g = jnp.where(jnp.arange(t) % 2 == 0, 0.0, -80.0)[None, :, None]
  args = args[:3] + (g,) + args[4:]
  out, fin, grads = run(xla_op(64), args, kw)
  for x in (out, fin, *grads.values()):
    assert bool(jnp.all(jnp.isfinite(x)))
  assert float(jnp.max(jnp.abs(out))) > 0


def test_config():
  with pytest.raises(pydantic.ValidationError):
    xla.Config(chunk_size=48)
  with pytest.raises(pydantic.ValidationError):
    xla.Config(block_size=1000)
  op = registry.get("gated_delta_rule", "xla")
  assert isinstance(op, xla.XlaGatedDeltaRule)
  assert isinstance(op.vjp, xla.XlaGatedDeltaRuleVjp)
  for t in (1, 20, 33, 5000):
    args, kw = make_inputs(0, t=t)
    ba = op.bind(*args, **kw)
    configs = op._get_autotuning_configs(ba)  # pylint: disable=protected-access
    assert {c.chunk_size for c in configs} == {16, 32, 64, 128}
    heuristic = op._get_heuristics_config(ba)  # pylint: disable=protected-access
    assert heuristic in configs
    # Block sizes of 2T or more run as one block like T's own: not explored.
    blocks = {c.block_size for c in configs} - {heuristic.block_size}
    assert all(b < 2 * t for b in blocks), blocks
    if t == 5000:
      assert blocks | {heuristic.block_size} == {256, 512, 1024, 2048, 4096, 8192}


@pytest.mark.parametrize(
    "t,hk,hv,chunk,block,vjp_block,gate,segment_starts",
    [
        # 3 blocks, the last one partial; a segment starts exactly at the
        # second block's first token and another inside the third block.
        (600, 1, 2, 64, 256, None, True, (256, 530)),
        # A segment crossing a block boundary; GVA 1:4; chunk 32.
        (520, 1, 4, 32, 256, None, False, (200,)),
        # The VJP's config names other blocks than the forward's: it follows
        # the forward's (whose entry states it gets).
        (700, 2, 2, 16, 256, 512, False, ()),
        (700, 1, 2, 64, 512, 256, True, (512,)),
    ],
)
def test_multiple_blocks_match_reference(t, hk, hv, chunk, block, vjp_block,
                                         gate, segment_starts):
  seg = _segments(t, segment_starts) if segment_starts else None
  args, kw = make_inputs(t + block, t=t, hk=hk, hv=hv, gate_params=gate,
                         segments=seg)
  assert_close(xla_op(chunk, block, vjp_block), args, kw)


def test_residuals_are_block_entry_states():
  """One block: nothing saved. Several: the f32 state entering each block,
  which equals the reference's final state over the tokens before it."""
  op = xla_op(32, 256)
  args, kw = make_inputs(12, t=200, hk=1, hv=2)
  _, res = op(*args, **kw, return_residuals=True)
  assert isinstance(res, xla.base.Residuals) and res.states is None

  t = 600
  args, kw = make_inputs(16, t=t, hk=1, hv=2)
  _, res = op(*args, **kw, return_residuals=True)
  b, _, hv, dv = args[2].shape
  assert res.states.shape == (b, hv, 3, args[0].shape[3], dv)
  assert res.states.dtype == jnp.float32
  for i, start in enumerate((0, 256, 512)):
    if start == 0:
      expected = kw["initial_state"]
    else:
      _, expected = tokamax_gdn.gated_delta_rule(
          *(x[:, :start] for x in args), **kw, implementation="reference")
    assert rel_rms(res.states[:, :, i], expected) <= 1e-5, i


@functools.cache
def _autodiff_grads(t, chunk, block=2048):
  """Autodiff through `chunked_forward` (a second, independent backward)."""
  args, kw = make_inputs(13, t=t, hk=1, hv=2)
  q, k, v, g, beta = args
  s0 = kw["initial_state"]

  def loss(q, k, v, g, beta, s0):
    out, fin, _ = xla_chunked_kernel.chunked_forward(q, k, v, g, beta, scale=0.25,
                                      initial_state=s0, segment_ids=None,
                                      chunk_size=chunk, block_size=block)
    return jnp.sum(jnp.sin(out)) + jnp.sum(fin * fin)

  auto = jax.jit(jax.grad(loss, argnums=range(6)))(q, k, v, g, beta, s0)

  @jax.jit
  def manual(q, k, v, g, beta, s0):
    out, fin, entries = xla_chunked_kernel.chunked_forward(
        q, k, v, g, beta, scale=0.25, initial_state=s0, segment_ids=None,
        chunk_size=chunk, block_size=block)
    return xla_chunked_kernel.chunked_backward(q, k, v, g, beta, jnp.cos(out), 2 * fin,
                                scale=0.25, initial_state=s0, segment_ids=None,
                                chunk_size=chunk, block_size=block,
                                block_entries=entries)

  return auto, manual(q, k, v, g, beta, s0)


def test_backward_without_matching_block_states_recomputes_them():
  """`chunked_backward` given no block states, or another tiling's, recomputes
  the ones it needs instead of misreading them."""
  args, kw = make_inputs(17, t=700, hk=1, hv=2)
  q, k, v, g, beta = args
  common = dict(scale=0.25, initial_state=kw["initial_state"], segment_ids=None)
  out, fin, at_256 = xla_chunked_kernel.chunked_forward(q, k, v, g, beta, chunk_size=32,
                                         block_size=256, **common)
  _, _, at_512 = xla_chunked_kernel.chunked_forward(q, k, v, g, beta, chunk_size=32,
                                     block_size=512, **common)
  assert at_256.shape[2] == 3 and at_512.shape[2] == 2
  bwd = lambda block, entries: xla_chunked_kernel.chunked_backward(
      q, k, v, g, beta, jnp.cos(out), fin, chunk_size=32, block_size=block,
      block_entries=entries, **common)
  expected = bwd(256, at_256)
  for got in (bwd(256, None), bwd(256, at_512), bwd(512, at_256)):
    for a, e in zip(got, expected):
      assert rel_rms(a, e) <= 1e-5


def test_vjp_follows_the_forward_blocks():
  for t, states_blocks, expected in ((700, None, 704), (700, 3, 256), (700, 2, 512),
                                     (5000, 3, 2048), (8192, 16, 512)):
    states = None if states_blocks is None else jnp.zeros((1, 1, states_blocks, 1, 1))
    assert xla.forward_block_size(t, 64, states) == expected


@pytest.mark.parametrize("t,chunk,block", [(50, 16, 2048), (300, 16, 256)])
def test_analytical_backward_matches_autodiff_of_chunked_forward(t, chunk, block):
  auto, manual = _autodiff_grads(t, chunk, block)
  for a, m in zip(auto, manual):
    assert rel_rms(m, a) <= 1e-5


def test_correlated_keys_slow_decay():
  """Near-identical keys and g ~ 0 make (I + A) badly conditioned for
  series-style inverses (FLA #537); forward substitution must stay exact."""
  args, kw = make_inputs(14, t=130, hk=1, hv=2)
  rng = np.random.default_rng(15)
  base_key = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
  k = base_key + 0.05 * rng.standard_normal(args[1].shape).astype(np.float32)
  k = k / np.linalg.norm(k, axis=-1, keepdims=True)
  g = -1e-3 * np.abs(rng.standard_normal(args[3].shape)).astype(np.float32)
  beta = 0.9 + 0.1 * np.asarray(args[4])
  args = (args[0], jnp.asarray(k), args[2], jnp.asarray(g), jnp.asarray(beta))
  assert_close(xla_op(128), args, kw)
