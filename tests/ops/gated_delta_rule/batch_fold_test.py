"""Short rows folded into one row with a segment per row (`batch_fold`), as the
Pallas kernels run them: forward and every gradient against the reference on
fresh random inputs, where the fold applies and where it must not, and NaN
isolation between the folded rows. Pallas runs in interpret mode: tiny shapes."""


import jax
from jax._src import core as jax_core
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn.ops.gated_delta_rule import batch_fold
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu
from tokamax_gdn.testing import specs

# Chunk 64 (the heuristic's 128 interprets slower); rows of 20 tokens fold.
OP = pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRule(
    config=pallas_mosaic_tpu.Config(chunk_size=64, interleave=2))
OP = OP.replace(vjp=OP.vjp.replace(config=pallas_mosaic_tpu.Config(chunk_size=64, interleave=2)))


def test_fold_unfold_and_segment_ids():
  x = jnp.arange(3 * 4 * 2).reshape(3, 4, 2)
  assert batch_fold.fold(x).shape == (1, 12, 2)
  np.testing.assert_array_equal(batch_fold.unfold(batch_fold.fold(x), 3), x)
  np.testing.assert_array_equal(batch_fold.segment_ids(None, 3, 4),
                                [[1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]])
  ids = jnp.array([[5, 5, 6, 6], [6, 6, 6, 6], [0, 1, 1, 2]])
  # Row 1 continues row 0's last id: still a new segment at its start.
  np.testing.assert_array_equal(batch_fold.segment_ids(ids, 3, 4),
                                [[1, 1, 2, 2, 3, 3, 3, 3, 4, 5, 5, 6]])
  assert batch_fold.folds(2, 16, 128) and batch_fold.folds(2, 127, 128)
  assert not batch_fold.folds(1, 16, 128) and not batch_fold.folds(2, 128, 128)


def _inputs(seed, b, t, *, hk=1, hv=2, dk=16, dv=16, dtype=jnp.float32):
  """Raw q, k, v, gate and beta logits [B, T, ...], a_log and dt_bias [Hv]."""
  r = np.random.default_rng(seed)
  n = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  args = (n(b, t, hk, dk).astype(dtype), n(b, t, hk, dk).astype(dtype),
          n(b, t, hv, dv).astype(dtype), n(b, t, hv), n(b, t, hv))
  return args, dict(a_log=0.5 * n(hv), dt_bias=0.5 * n(hv))


def _loss(impl, static):
  def loss(args, diff, cot):
    out, final = tokamax_gdn.gated_delta_rule(
        *args, use_qk_l2norm=True, use_beta_sigmoid=True, implementation=impl, **diff, **static)
    value = jnp.sum(out.astype(jnp.float32) * cot[0])
    if final is not None:
      value += jnp.sum(final * cot[1])
    return value, out
  return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)


def _kernel_rows(args, diff, static, cot) -> dict[str, tuple[int, int]]:
  """{Pallas kernel name: the first two dims of its first output} in the
  step's program (not run): [rows, tokens] of `gdn_fwd` / `gdn_bwd`, [rows,
  chunks] of the states pass `gdn_fwd_states`."""
  with tokamax_gdn.config.interpret_mode():
    jaxpr = jax.make_jaxpr(_loss(OP, static))(args, diff, cot)
  found = {}

  def walk(j):
    for eqn in j.eqns:
      if eqn.primitive.name == "pallas_call":
        found[str(eqn.params["name"])] = tuple(eqn.outvars[0].aval.shape[:2])
      for sub in jax_core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr.jaxpr)
  return found


def _cotangents(seed, args, static):
  b, t, hv, dv = args[2].shape
  r = np.random.default_rng(seed)
  return (jnp.asarray(r.standard_normal((b, t, hv, dv)), jnp.float32),
          jnp.asarray(r.standard_normal((b, hv, args[0].shape[-1], dv)), jnp.float32)
          if static.get("output_final_state") else None)


def _check_against_reference(args, diff, static, seed=3):
  cot = _cotangents(seed, args, static)
  with tokamax_gdn.config.interpret_mode():
    (_, out), grads = jax.jit(_loss(OP, static))(args, diff, cot)
  f32 = jax.tree.map(lambda x: x.astype(jnp.float32), args)
  (_, rout), rgrads = jax.jit(_loss("reference", static))(f32, diff, cot)
  dtype = args[0].dtype
  assert specs.rel_rms(out, rout) < specs.tolerance(dtype, grad=False)
  for (path, g), e in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(rgrads)):
    assert specs.rel_rms(g, e) < specs.tolerance(dtype, grad=True), jax.tree_util.keystr(path)


def test_folded_with_segment_ids_matches_reference():
  """5 rows of 20 tokens, each with two segments of its own, run as one row
  of 100 (two chunks: row 3 spans the chunk boundary): out and the gradients
  of q, k, v, the gate, beta, a_log and dt_bias."""
  args, diff = _inputs(0, 5, 20)
  seg = jnp.asarray(np.broadcast_to((np.arange(20) >= 7).astype(np.int32), (5, 20)))
  static = dict(segment_ids=seg)
  rows = _kernel_rows(args, diff, static, _cotangents(3, args, static))
  assert rows == {"gdn_fwd": (1, 100), "gdn_fwd_states": (1, 2), "gdn_bwd": (1, 100)}, rows
  _check_against_reference(args, diff, static)


def test_folded_bf16_rows_keep_a_nan_to_their_own_row():
  """bf16, no segment ids: as the reference; then a NaN in row 1's keys and
  in row 2's output cotangent change nothing in the other rows' outputs or
  gradients (one compiled program for both runs)."""
  args, diff = _inputs(1, 3, 16, dtype=jnp.bfloat16)
  assert _kernel_rows(args, diff, {}, _cotangents(4, args, {}))["gdn_bwd"] == (1, 48)
  _check_against_reference(args, diff, {}, seed=4)
  step = jax.jit(_loss(OP, {}))
  cot = _cotangents(4, args, {})
  bad_args = (args[0], args[1].at[1, 5, 0, 3].set(jnp.nan)) + args[2:]
  bad_cot = (cot[0].at[2, 9, 1, 0].set(jnp.nan), None)
  with tokamax_gdn.config.interpret_mode():
    (_, out), (grads, _) = step(args, diff, cot)
    (_, bad_out), (bad_grads, _) = step(bad_args, diff, bad_cot)
  assert np.isnan(np.asarray(bad_out[1], np.float32)).any()
  np.testing.assert_array_equal(bad_out[0], out[0])
  np.testing.assert_array_equal(bad_out[2], out[2])
  for g, bad in zip(grads, bad_grads):
    np.testing.assert_array_equal(bad[0], g[0])      # row 0: neither NaN reaches it
    assert np.isnan(np.asarray(bad[1:], np.float32)).any()


@pytest.mark.parametrize("static", [
    dict(output_final_state=True), dict(initial_state=True)], ids=["final_state", "initial_state"])
def test_not_folded_where_a_state_crosses_the_call(static):
  """A final state asked for or an initial state given: the rows run as
  rows (their states are per row), in the forward and the backward."""
  args, diff = _inputs(2, 3, 16)
  if static.pop("initial_state", False):
    diff["initial_state"] = jnp.asarray(
        np.random.default_rng(5).standard_normal((3, 2, 16, 16)), jnp.float32)
  rows = _kernel_rows(args, diff, static, _cotangents(3, args, static))
  assert {n: r[0] for n, r in rows.items()} == dict.fromkeys(rows, 3), rows
  assert rows["gdn_fwd"] == rows["gdn_bwd"] == (3, 16), rows


def test_stateful_call_matches_reference():
  """The not-folded path of the same shapes, initial state in and final state
  out: every gradient, the initial state's included, as the reference's."""
  args, diff = _inputs(6, 3, 16)
  diff["initial_state"] = jnp.asarray(
      0.5 * np.random.default_rng(7).standard_normal((3, 2, 16, 16)), jnp.float32)
  _check_against_reference(args, diff, dict(output_final_state=True))
