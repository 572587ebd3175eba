"""Per-segment initial/final states ([B, N, Hv, K, V] with `segment_ids`) equal
running each segment on its own from its own state, forward and gradients,
for every implementation."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.testing.specs import rel_rms, tolerance

from . import test_base as h  # pylint: disable=relative-beyond-top-level

OP = "gated_delta_rule"


def _impls():
  return [pytest.param(name, id=name) for name in registry.implementations(OP)]


def _segment_ids(lengths_per_row):
  rows = []
  for lengths in lengths_per_row:
    rows.append(np.concatenate([np.full(n, 10 * i + 3, np.int32) for i, n in enumerate(lengths)]))
  return jnp.asarray(np.stack(rows))


def _problem(lengths_per_row, n_states, *, hk=1, hv=2, dk=8, dv=8, gate=False, seed=0):
  t = sum(lengths_per_row[0])
  b = len(lengths_per_row)
  diff, _ = h.inputs(seed, b=b, t=t, hk=hk, hv=hv, dk=dk, dv=dv, gate=gate,
                     initial_state=False)
  diff["initial_state"] = 0.5 * jax.random.normal(jax.random.key(seed + 1),
                                                  (b, n_states, hv, dk, dv))
  ct_key = jax.random.split(jax.random.key(seed + 2), 2)
  cts = (jax.random.normal(ct_key[0], (b, t, hv, dv)),
         jax.random.normal(ct_key[1], (b, n_states, hv, dk, dv)))
  return diff, _segment_ids(lengths_per_row), cts


def _packed(impl, diff, segment_ids, cts, use_qk_l2norm):
  """Loss and grads of the packed call with per-segment states."""
  static = dict(segment_ids=segment_ids, output_final_state=True,
                use_qk_l2norm=use_qk_l2norm)
  return h.fwd_bwd(impl, diff, static, cts)


@functools.cache
def _expected(lengths, n_states, hk, hv, gate, l2norm):
  """The problem and the separate runs' results, once per case for all impls."""
  lengths = [list(row) for row in lengths]
  diff, segment_ids, cts = _problem(lengths, n_states, hk=hk, hv=hv, gate=gate)
  return diff, segment_ids, cts, _separately(diff, lengths, cts, l2norm)


def _separately(diff, lengths_per_row, cts, use_qk_l2norm):
  """The same loss from each segment run alone by the reference: segment n < N
  from initial_state[b, n], later ones from zeros (their end states unused)."""
  n_states = diff["initial_state"].shape[1]

  def loss(d):
    total, outs, finals = 0.0, [], []
    for b, lengths in enumerate(lengths_per_row):
      start, row_out = 0, []
      row_final = [jnp.zeros_like(d["initial_state"][b, 0])] * n_states
      for n, length in enumerate(lengths):
        piece = {m: d[m][b:b + 1, start:start + length] for m in h.POSITIONAL}
        s0 = (d["initial_state"][b:b + 1, n] if n < n_states
              else jnp.zeros_like(d["initial_state"][b:b + 1, 0]))
        out, final = tokamax_gdn.gated_delta_rule(
            *[piece[m] for m in h.POSITIONAL], initial_state=s0, output_final_state=True,
            use_qk_l2norm=use_qk_l2norm, a_log=d.get("a_log"), dt_bias=d.get("dt_bias"),
            implementation="reference")
        row_out.append(out[0])
        if n < n_states:
          row_final[n] = final[0]
        start += length
      outs.append(jnp.concatenate(row_out))
      finals.append(jnp.stack(row_final))
    out, final = jnp.stack(outs), jnp.stack(finals)
    return jnp.sum(out * cts[0]) + jnp.sum(final * cts[1]), (out, final)

  (_, (out, final)), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(diff)
  return out, final, grads


CASES = [
    # (segment lengths per row, N, hk, hv, gate, l2norm)
    pytest.param([[5, 30, 1, 20], [56]], 4, 1, 2, False, False, id="N4_one_token_segment"),
    # Fewer segments than states in row 1; more in row 0 (the last one starts
    # from zeros and its end state is not returned).
    pytest.param([[17, 16, 40], [50, 23]], 2, 1, 4, True, True, id="N2_overflow_gva4_gate"),
    # Segments across several chunks at any chunk size, one of exactly 64.
    pytest.param([[64, 100, 3]], 3, 2, 2, False, True, id="N3_long_segments"),
]


def _case_params():
  """Every case for reference and xla; the two short ones for Pallas, which
  runs in interpret mode off TPU."""
  out = []
  for impl in _impls():
    for case in CASES if impl.id != "pallas_mosaic_tpu" else CASES[:2]:
      out.append(pytest.param(impl.values[0], *case.values, marks=(*impl.marks, *case.marks),
                              id=f"{impl.id}-{case.id}"))
  return out


@pytest.mark.parametrize("impl,lengths,n_states,hk,hv,gate,l2norm", _case_params())
def test_per_segment_states_equal_separate_runs(impl, lengths, n_states, hk, hv, gate,
                                                l2norm):
  diff, segment_ids, cts, want = _expected(
      tuple(map(tuple, lengths)), n_states, hk, hv, gate, l2norm)
  want_out, want_final, want_grads = want
  out, final, grads = _packed(impl, diff, segment_ids, cts, l2norm)
  assert final.shape == want_final.shape == diff["initial_state"].shape
  tol, gtol = tolerance(jnp.float32, grad=False), tolerance(jnp.float32, grad=True)
  errs = {"out": (rel_rms(out, want_out), tol), "final": (rel_rms(final, want_final), tol)}
  for name, g in want_grads.items():
    errs["d_" + name] = (rel_rms(grads[name], g), gtol)
  bad = {n: e for n, e in errs.items() if not e[0] <= e[1]}
  assert not bad, bad
  # Rows with fewer segments than states: zeros, and no gradient to the unused states.
  for b, row in enumerate(lengths):
    for n in range(len(row), n_states):
      np.testing.assert_array_equal(final[b, n], 0.0)
      np.testing.assert_array_equal(grads["initial_state"][b, n], 0.0)


@pytest.mark.parametrize("impl", _impls())
def test_per_segment_states_zero_tokens(impl):
  """T = 0: no segments, so zero final states and zero state gradients."""
  diff, _, _ = _problem([[3]], 2)
  diff = {n: x[:, :0] if n in h.POSITIONAL else x for n, x in diff.items()}
  seg = jnp.zeros((1, 0), jnp.int32)

  def loss(s):
    d = dict(diff, initial_state=s)
    out, final = tokamax_gdn.gated_delta_rule(
        *[d.pop(n) for n in h.POSITIONAL], **d, segment_ids=seg, output_final_state=True,
        implementation=impl)
    return jnp.sum(final), final

  with h.context(impl):
    grad, final = jax.jit(jax.grad(loss, has_aux=True))(diff["initial_state"])
  assert final.shape == diff["initial_state"].shape
  np.testing.assert_array_equal(final, 0.0)
  np.testing.assert_array_equal(grad, 0.0)


def _assert_packed_equals_separate(op, lengths, *, n_states):
  """`op` (a configured instance) on one row of packed segments, GVA 1:2,
  qk-l2norm and gate parameters, against separate runs; returns (inputs,
  segment ids)."""
  diff, segment_ids, cts, want = _expected(lengths, n_states, 1, 2, True, True)
  out, final, grads = _packed(op, diff, segment_ids, cts, True)
  want_out, want_final, want_grads = want
  tol, gtol = tolerance(jnp.float32, grad=False), tolerance(jnp.float32, grad=True)
  assert rel_rms(out, want_out) <= tol and rel_rms(final, want_final) <= tol
  for name, g in want_grads.items():
    assert rel_rms(grads[name], g) <= gtol, name
  return diff, segment_ids


@pytest.mark.parametrize("chunk,block,vjp_block", [(16, 256, None), (32, 256, 512)])
def test_xla_per_segment_states_over_several_blocks(chunk, block, vjp_block):
  """Aligned layouts longer than one block (segments crossing blocks, the
  backward restarting blocks from the saved entry states or, with another
  block size, recomputing them), at small and large chunks."""
  from tokamax_gdn.ops.gated_delta_rule import xla  # pylint: disable=g-import-not-at-top
  op = registry.get(OP, "xla")
  op = op.replace(config=xla.Config(chunk_size=chunk, block_size=block),
                  vjp=op.vjp.replace(config=xla.Config(chunk_size=chunk,
                                                       block_size=vjp_block or block)))
  _assert_packed_equals_separate(op, ((100, 150, 7, 63),), n_states=3)


def test_pallas_per_segment_states_with_saved_residuals_at_c64():
  """Pallas at C=64 with the forward's saved states (one per chunk of the
  aligned layout, which the backward runs on): segments over several chunks,
  one ending exactly on a chunk boundary, and more segments than states."""
  from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu  # pylint: disable=g-import-not-at-top
  cfg = pallas_mosaic_tpu.Config(chunk_size=64, interleave=2, save_states=True)
  op = registry.get(OP, "pallas_mosaic_tpu")
  op = op.replace(config=cfg, vjp=op.vjp.replace(config=cfg))
  lengths = ((64, 70, 2, 9, 5),)
  diff, segment_ids = _assert_packed_equals_separate(op, lengths, n_states=2)
  d = dict(diff)
  with h.context(op):
    _, residuals = jax.eval_shape(lambda d: op(
        *[d.pop(n) for n in h.POSITIONAL], **d, segment_ids=segment_ids,
        output_final_state=True, use_qk_l2norm=True, return_residuals=True), d)
  from tokamax_gdn.ops import segments  # pylint: disable=g-import-not-at-top
  assert residuals.states.shape[1] == segments.aligned_length(sum(lengths[0]), 2, 64) // 64
