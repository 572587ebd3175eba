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

from . import test_base as h  # pylint: disable=relative-beyond-top-level


def xla_op(chunk_size, block_size=2048, vjp_block_size=None):
  """The xla Op with its forward (and VJP) config fixed."""
  return h.with_config("xla", chunk_size=chunk_size, block_size=block_size,
                       vjp=dict(block_size=vjp_block_size or block_size))


def _inputs(seed, **kw):
  """Harness inputs with exactly unit keys and an initial state."""
  kw.setdefault("unit_keys", True)
  return h.inputs(seed, **kw)


@pytest.mark.parametrize(
    "hk,hv,t,chunk,l2norm,gate",
    [
        (1, 1, 1, 16, False, False),
        (2, 2, 63, 16, True, True),
        (1, 4, 65, 64, True, False),
        (2, 4, 65, 128, False, True),
        # Chunk 32 and several blocks: test_multiple_blocks_match_reference.
    ],
)
def test_matches_reference(hk, hv, t, chunk, l2norm, gate):
  diff, static = _inputs(t + hv, b=1, t=t, hk=hk, hv=hv, dk=16, dv=8, gate=gate,
                         unit_keys=not l2norm)
  if l2norm:  # unnormalised q/k with a spread of norms
    diff["query"], diff["key"] = diff["query"] * 3.0, diff["key"] * 0.7
  h.check_against_reference(xla_op(chunk), diff, {**static, "use_qk_l2norm": l2norm})


def test_default_config_and_public_api_under_jit_grad():
  diff, _ = _inputs(1, b=1, t=40, hk=1, hv=2, dk=16, dv=8)
  args = [diff[n] for n in h.POSITIONAL]
  kw = dict(initial_state=diff["initial_state"])

  def grads(impl):
    def loss(*a):
      out, _ = tokamax_gdn.gated_delta_rule(*a, **kw, implementation=impl)
      return jnp.sum(out**2)
    return jax.jit(jax.grad(loss, argnums=range(5)))(*args)

  for a, r in zip(grads("xla"), grads("reference")):
    assert rel_rms(a, r) <= tolerance(jnp.float32, grad=True)


def test_segment_resets():
  t = 100
  # Chunk 32: boundaries inside chunks, at a chunk start (64), a one-token
  # segment (37) and a boundary at t = 1.
  seg = jnp.concatenate([h.segment_ids(t, [5, 37, 38, 64, 90]),
                         h.segment_ids(t, [1, 50])], axis=0)
  diff, static = _inputs(3, b=2, t=t, hk=1, hv=2, dk=16, dv=8)
  h.check_against_reference(xla_op(32), diff, {**static, "segment_ids": seg})


def test_gates_exactly_zero_and_minus_80():
  """Row 0: g exactly 0 on half the tokens; row 1: g = -80 on 30% of them."""
  diff, static = _inputs(6, b=2, t=70, hk=1, hv=2, dk=16, dv=8)
  rng = np.random.default_rng(7)
  g = np.array(diff["g"])
  g[0][rng.random(g[0].shape) < 0.5] = 0.0
  g[1][rng.random(g[1].shape) < 0.3] = -80.0
  assert (g[0] == 0).mean() > 0.4 and (g[1] == -80).mean() > 0.2
  diff["g"] = jnp.asarray(g)
  h.check_against_reference(xla_op(32), diff, static)


def test_bf16_inputs():
  diff, static = _inputs(10, b=1, t=65, hk=1, hv=2, dk=16, dv=8, dtype=jnp.bfloat16)
  (out, fin, grads), _ = h.check_against_reference(xla_op(32), diff, static)
  assert out.dtype == jnp.bfloat16 and fin.dtype == jnp.float32
  assert grads["query"].dtype == jnp.bfloat16
  assert grads["initial_state"].dtype == jnp.float32


def test_config():
  with pytest.raises(pydantic.ValidationError):
    xla.Config(chunk_size=48)
  with pytest.raises(pydantic.ValidationError):
    xla.Config(block_size=1000)
  op = registry.get("gated_delta_rule", "xla")
  assert isinstance(op, xla.XlaGatedDeltaRule)
  assert isinstance(op.vjp, xla.XlaGatedDeltaRuleVjp)
  for t in (1, 20, 33, 5000):
    diff, static = _inputs(0, b=1, t=t, hk=1, hv=2, dk=16, dv=8)
    d = dict(diff)
    ba = op.bind(*[d.pop(n) for n in h.POSITIONAL], **d, **static)
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
  diff, static = _inputs(t + block, b=1, t=t, hk=hk, hv=hv, dk=16, dv=8, gate=gate)
  if segment_starts:
    static["segment_ids"] = h.segment_ids(t, segment_starts)
  h.check_against_reference(xla_op(chunk, block, vjp_block), diff, static)


def test_residuals_are_block_entry_states():
  """One block: nothing saved. Several: the f32 state entering each block,
  which equals the reference's final state over the tokens before it."""
  op = xla_op(32, 256)

  def positional(diff):
    d = dict(diff)
    return [d.pop(n) for n in h.POSITIONAL], d

  # Jitted: eager dispatch compiles every primitive of the chunked algebra.
  run = jax.jit(lambda a, kw: op(*a, **kw, output_final_state=True, return_residuals=True))
  args, kw = positional(_inputs(12, b=1, t=200, hk=1, hv=2, dk=16, dv=8)[0])
  _, res = run(args, kw)
  assert isinstance(res, xla.base.Residuals) and res.states is None

  t = 600
  args, kw = positional(_inputs(16, b=1, t=t, hk=1, hv=2, dk=16, dv=8)[0])
  _, res = run(args, kw)
  b, _, hv, dv = args[2].shape
  assert res.states.shape == (b, hv, 3, args[0].shape[3], dv)
  assert res.states.dtype == jnp.float32
  for i, start in enumerate((0, 256, 512)):
    if start == 0:
      expected = kw["initial_state"]
    else:
      _, expected = jax.jit(lambda a, kw: tokamax_gdn.gated_delta_rule(
          *a, **kw, output_final_state=True, implementation="reference"))(
              [x[:, :start] for x in args], kw)
    assert rel_rms(res.states[:, :, i], expected) <= 1e-5, i


def _kernel_inputs(seed, t):
  diff, _ = _inputs(seed, b=1, t=t, hk=1, hv=2, dk=16, dv=8)
  return [diff[n] for n in h.POSITIONAL], diff["initial_state"]


@functools.cache
def _autodiff_grads(t, chunk, block=2048, segment_bounds=()):
  """Autodiff through `chunked_forward` (a second, independent backward)."""
  (q, k, v, g, beta), s0 = _kernel_inputs(13, t)
  common = dict(scale=0.25, chunk_size=chunk, block_size=block,
                segment_ids=h.segment_ids(t, segment_bounds) if segment_bounds else None)

  def loss(q, k, v, g, beta, s0):
    out, fin, _ = xla_chunked_kernel.chunked_forward(q, k, v, g, beta, initial_state=s0,
                                                     **common)
    return jnp.sum(jnp.sin(out)) + jnp.sum(fin * fin)

  auto = jax.jit(jax.grad(loss, argnums=range(6)))(q, k, v, g, beta, s0)

  @jax.jit
  def manual(q, k, v, g, beta, s0):
    out, fin, entries = xla_chunked_kernel.chunked_forward(
        q, k, v, g, beta, initial_state=s0, **common)
    return xla_chunked_kernel.chunked_backward(
        q, k, v, g, beta, jnp.cos(out), 2 * fin, initial_state=s0,
        block_entries=entries, **common)

  return auto, manual(q, k, v, g, beta, s0)


def test_backward_without_matching_block_states_recomputes_them():
  """`chunked_backward` given no block states, or another tiling's, recomputes
  the ones it needs instead of misreading them."""
  (q, k, v, g, beta), s0 = _kernel_inputs(17, 700)
  common = dict(scale=0.25, initial_state=s0, segment_ids=None)
  out, fin, at_256 = xla_chunked_kernel.chunked_forward(
      q, k, v, g, beta, chunk_size=32, block_size=256, **common)
  _, _, at_512 = xla_chunked_kernel.chunked_forward(
      q, k, v, g, beta, chunk_size=32, block_size=512, **common)
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


@pytest.mark.parametrize("t,chunk,block,segment_bounds", [
    (300, 16, 256, ()),
    # Starts inside chunks, at a chunk start, a one-token segment: the
    # segment-restarted gate cumsum and its segment-restarted transpose.
    (100, 32, 2048, (5, 37, 38, 64, 90)),
])
def test_analytical_backward_matches_autodiff_of_chunked_forward(t, chunk, block,
                                                                 segment_bounds):
  auto, manual = _autodiff_grads(t, chunk, block, segment_bounds)
  for a, m in zip(auto, manual):
    assert rel_rms(m, a) <= 1e-5


def test_correlated_keys_slow_decay():
  """Near-identical keys and g ~ 0 make (I + A) badly conditioned for
  series-style inverses (FLA #537); forward substitution must stay exact."""
  diff, static = _inputs(14, b=1, t=130, hk=1, hv=2, dk=16, dv=8)
  rng = np.random.default_rng(15)
  base_key = rng.standard_normal((1, 1, 1, 16)).astype(np.float32)
  k = base_key + 0.05 * rng.standard_normal(diff["key"].shape).astype(np.float32)
  diff["key"] = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True))
  diff["g"] = jnp.asarray(-1e-3 * np.abs(rng.standard_normal(diff["g"].shape)), jnp.float32)
  diff["beta"] = 0.9 + 0.1 * diff["beta"]
  h.check_against_reference(xla_op(128), diff, static)


@pytest.mark.parametrize("c", [16, 64, 128])
def test_chunk_gate_compensated_cumsum(c):
  """`chunk_gate` at a chunk of c tokens: gates at the -30 floor for most of
  it, then tiny ones. A plain float32 cumsum has |G| ~ 30 c there and rounds
  the tiny gates away (relative errors ~1e-3 in gamma and decay_out); the
  (hi, lo) pair keeps gamma, decay_in/out within 1e-6 of float64, with and
  without a segment start."""
  n_floor = c * 5 // 8
  g = np.concatenate([np.full(n_floor, -30.0), -np.geomspace(1e-6, 1e-4, c - n_floor)])
  g = g.astype(np.float32)
  for starts in (None, np.arange(c) == c // 3):
    # Jitted, as the chunked kernels run it (and one compile, not one per primitive).
    names = ("gamma", "decay_out", "decay_in")
    fields = jax.jit(lambda g, s: [getattr(xla_chunked_kernel.chunk_gate(g, s), n)
                                   for n in names])(
        jnp.asarray(g), None if starts is None else jnp.asarray(starts))
    gate = dict(zip(names, fields))
    g64 = g.astype(np.float64)
    seg = np.zeros(c, int) if starts is None else np.cumsum(starts)
    gcum = np.array([g64[(seg == seg[i]) & (np.arange(c) <= i)].sum() for i in range(c)])
    same = (seg[:, None] == seg[None, :]) & np.tril(np.ones((c, c), bool))
    gamma = np.where(same, np.exp(np.where(same, gcum[:, None] - gcum[None, :], 0)), 0)
    last = seg == seg[-1]
    decay_out = np.where(last, np.exp(np.where(last, gcum[-1] - gcum, 0)), 0)
    decay_in = np.where(seg == 0, np.exp(gcum), 0)
    for name, want in (("gamma", gamma), ("decay_out", decay_out), ("decay_in", decay_in)):
      got = np.asarray(gate[name], np.float64)
      np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-30, err_msg=name)
