"""Packed sequences are isolated: a NaN or inf in one segment's inputs or
cotangents reaches neither another segment's outputs, final state nor
gradients, within a chunk and across chunk boundaries; the poisoned segment's
own results are non-finite (never finite and silently wrong)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import registry

from . import test_base as h  # pylint: disable=relative-beyond-top-level

OP = "gated_delta_rule"
# Three segments: [0, 20), [20, 45), [45, 70). At chunk 16 segment 1 spans
# three chunks, two of them shared with its neighbours; at chunk 64 (Pallas)
# all three meet inside one chunk.
BOUNDS = (0, 20, 45, 70)
BAD_TOKEN = 30
HV, GROUP = 4, 2


def _op(impl, chunk):
  """The implementation with its chunk size fixed (where it has one)."""
  return impl if chunk is None else h.with_config(impl, chunk_size=chunk)


# The guard is in the base Op, shared by every implementation, except that the
# Pallas kernels run all of it in VMEM (`whole_guard_in_core`; with
# per-segment states they take the XLA flags and zero non-finite q, k, v, dO
# in VMEM, `guards_in_core`); the Pallas kernel (interpret mode, slow on CPU)
# runs one case of each input at its smallest chunk (64: the three segments
# share one chunk). xla runs at chunk 16, where segment 1 shares chunks with
# both neighbours and spans a chunk boundary.
CHUNKS = {"reference": None, "xla": 16, "pallas_mosaic_tpu": 64}
# (A NaN beta: `test_beta_logits_...`, as a NaN logit, the layer's beta.)
PALLAS_CASES = (("value", np.nan), ("d_out", np.inf), ("key", np.nan), ("query", np.inf),
                ("g", np.nan), ("initial_state", np.nan))


def _params(cases=None):
  """(impl, chunk[, name, value]) params: every case for reference and xla,
  PALLAS_CASES for Pallas."""
  out = []
  for impl in registry.implementations(OP):
    c = CHUNKS[impl]
    if cases is None:
      out.append(pytest.param(impl, c, id=f"{impl}-C{c}"))
      continue
    impl_cases = PALLAS_CASES if impl == "pallas_mosaic_tpu" else cases
    out += [pytest.param(impl, c, n, v, id=f"{impl}-C{c}-{n}={v}") for n, v in impl_cases]
  return out


def _problem(per_segment_states=False, dtype=jnp.float32):
  t = BOUNDS[-1]
  diff, static = h.inputs(3, b=2, t=t, hk=HV // GROUP, hv=HV, dk=8, dv=8, gate=True,
                          dtype=dtype)
  seg = np.zeros((2, t), np.int32)
  for i, start in enumerate(BOUNDS[1:-1]):
    seg[:, start:] = i + 1
  if per_segment_states:
    diff["initial_state"] = jnp.stack([diff["initial_state"] * (n + 1) for n in range(3)], 1)
  static.update(segment_ids=jnp.asarray(seg), use_qk_l2norm=True)
  return diff, static, h.cotangents(diff, static, seed=4)


def _run(op, diff, static, cts):
  return h.fwd_bwd(op, diff, static, cts)


@functools.cache
def _clean_run(impl, chunk, per_segment_states=False):
  """The finite problem's results, once per implementation and chunk."""
  diff, static, cts = _problem(per_segment_states)
  return _run(_op(impl, chunk), diff, static, cts)


def _inject(diff, cts, name, value):
  """Row 0, token BAD_TOKEN (segment 1), value head 1 (key head 0), or the
  state of row 0 (segment 0 for a [B, Hv, K, V] state, segment 1 for
  per-segment states)."""
  diff, cts = dict(diff), list(cts)
  if name == "initial_state":
    idx = (0, 1, 0) if diff[name].ndim == 4 else (0, 1, 1, 0, 0)
    diff[name] = diff[name].at[idx].set(value)
  elif name == "d_out":
    cts[0] = cts[0].at[0, BAD_TOKEN, 1, 2].set(value)
  elif name in ("query", "key"):
    diff[name] = diff[name].at[0, BAD_TOKEN, 0, 2].set(value)
  elif name == "value":
    diff[name] = diff[name].at[0, BAD_TOKEN, 1, 2].set(value)
  else:
    diff[name] = diff[name].at[0, BAD_TOKEN, 1].set(value)
  return diff, tuple(cts)


CASES = [("query", np.nan), ("key", np.inf), ("value", np.nan), ("value", -np.inf),
         ("g", np.nan), ("g", np.inf), ("beta", np.nan), ("initial_state", np.nan),
         ("d_out", np.inf)]


def _assert_same(a, b, what):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6, err_msg=what)


def _all_nonfinite(x, what):
  assert not np.isfinite(np.asarray(x, np.float32)).any(), what


@pytest.mark.parametrize("impl,chunk,name,value", _params(CASES))
def test_bad_value_stays_in_its_segment(impl, chunk, name, value):
  op = _op(impl, chunk)
  diff, static, cts = _problem()
  clean = _clean_run(impl, chunk)
  bad_diff, bad_cts = _inject(diff, cts, name, value)
  out, final, grads = _run(op, bad_diff, static, bad_cts)
  c_out, c_final, c_grads = clean
  s0, s1 = BOUNDS[1], BOUNDS[2]
  poisoned = slice(0, s0) if name == "initial_state" else slice(s0, s1)
  others = [slice(0, s0), slice(s1, None)] if poisoned.start else [slice(s0, None)]
  # Row 1 and the other segments of row 0: equal to the clean run.
  _assert_same(out[1], c_out[1], "row 1 out")
  _assert_same(final[1], c_final[1], "row 1 final")
  for sl in others:
    _assert_same(out[0, sl], c_out[0, sl], f"out {sl}")
  _assert_same(final[0], c_final[0], "final (of the last segment)")
  for n in h.POSITIONAL:
    _assert_same(grads[n][1], c_grads[n][1], f"row 1 d{n}")
    for sl in others:
      _assert_same(grads[n][0, sl], c_grads[n][0, sl], f"d{n} {sl}")
  if name != "initial_state":
    _assert_same(grads["initial_state"], c_grads["initial_state"], "d_initial_state")
  else:
    _assert_same(grads["initial_state"][1], c_grads["initial_state"][1], "row 1 d_initial")
  # The poisoned segment: value head 1 (and key head 0) non-finite.
  if name == "query":
    _all_nonfinite(out[0, BAD_TOKEN, 0:2], "out at the bad query")
    _assert_same(out[0, BAD_TOKEN + 1:s1], c_out[0, BAD_TOKEN + 1:s1], "later outputs")
  elif name == "d_out":
    _assert_same(out, c_out, "out (only the cotangent is bad)")
  elif name == "initial_state":
    _all_nonfinite(out[0, :s0, 1], "segment 0 out")
  else:
    _all_nonfinite(out[0, BAD_TOKEN:s1, 1], "out from the bad token on")
    _assert_same(out[0, s0:BAD_TOKEN], c_out[0, s0:BAD_TOKEN], "outputs before it")
  # Gradients: NaN from the first bad input on, at and before a bad
  # cotangent; never before a bad input (NaN does not flow backwards).
  if name == "initial_state":
    nan_grads, finite_grads = poisoned, slice(0, 0)
  elif name == "d_out":
    nan_grads, finite_grads = slice(s0, BAD_TOKEN + 1), slice(BAD_TOKEN + 1, s1)
  elif name == "query":
    nan_grads, finite_grads = slice(BAD_TOKEN, BAD_TOKEN + 1), slice(s0, BAD_TOKEN)
  else:
    nan_grads, finite_grads = slice(BAD_TOKEN, s1), slice(s0, BAD_TOKEN)
  for n, head in (("value", 1), ("g", 1), ("beta", 1), ("query", 0), ("key", 0)):
    _all_nonfinite(grads[n][0, nan_grads, head], f"d{n} of the poisoned tokens")
    h.assert_finite(grads[n][0, finite_grads], f"d{n} before the bad token")
  if name == "d_out":       # later tokens do not read the bad cotangent
    for n in h.POSITIONAL:
      _assert_same(grads[n][0, finite_grads], c_grads[n][0, finite_grads], f"d{n} after")
  if name == "initial_state":
    _all_nonfinite(grads["initial_state"][0, 1], "d_initial_state")


@pytest.mark.parametrize("name,value", [("key", np.nan), ("value", np.inf)])
def test_pallas_bfloat16_bad_value_stays_in_its_segment(name, value):
  """bfloat16 inputs, forward: the Pallas kernel's bf16 forms of the guard
  (the flags' x·0 and the outputs' NaN taken in bf16) poison the segment from
  the bad token on and leave every other output as in the clean run."""
  op = _op("pallas_mosaic_tpu", CHUNKS["pallas_mosaic_tpu"])
  diff, static, cts = _problem(dtype=jnp.bfloat16)
  c_out, c_final = h.call(op, diff, static)
  out, final = h.call(op, *_inject(diff, cts, name, value)[:1], static)
  s0, s1 = BOUNDS[1], BOUNDS[2]
  for what, a, b in (("row 1", out[1], c_out[1]), ("segment 0", out[0, :s0], c_out[0, :s0]),
                     ("before the bad token", out[0, s0:BAD_TOKEN], c_out[0, s0:BAD_TOKEN]),
                     ("segment 2", out[0, s1:], c_out[0, s1:]), ("final", final, c_final)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), what)
  _all_nonfinite(out[0, BAD_TOKEN:s1, 1], "out from the bad token on")
  if name == "key":         # key head 0 is read by value heads 0 and 1
    _all_nonfinite(out[0, BAD_TOKEN:s1, 0], "out of the key head's other value head")


@pytest.mark.parametrize("impl,chunk", _params())
def test_bad_final_state_cotangent_stays_in_the_last_segment(impl, chunk):
  """A NaN in the final state's cotangent (of the state after the row's last
  token: segment 2's) makes the gradients of segment 2's tokens NaN, at and
  before its last token, and no others (the Pallas backward carries it from
  the last chunk in reverse)."""
  diff, static, cts = _problem()
  _, _, c_grads = _clean_run(impl, chunk)
  bad_cts = (cts[0], cts[1].at[0, 1, 2, 3].set(np.nan))
  _, _, grads = _run(_op(impl, chunk), diff, static, bad_cts)
  s1 = BOUNDS[2]
  for n in h.POSITIONAL:
    _assert_same(grads[n][1], c_grads[n][1], f"row 1 d{n}")
    _assert_same(grads[n][0, :s1], c_grads[n][0, :s1], f"d{n} of segments 0 and 1")
  _assert_same(grads["initial_state"], c_grads["initial_state"], "d_initial_state")
  for n, head in (("value", 1), ("g", 1), ("beta", 1), ("query", 0), ("key", 0)):
    _all_nonfinite(grads[n][0, s1:, head], f"d{n} of segment 2")


@pytest.mark.parametrize("impl,chunk", [p for p in _params() if "pallas" not in p.id])
def test_per_segment_state_bad_value_stays_in_its_segment(impl, chunk):
  op = _op(impl, chunk)
  diff, static, cts = _problem(per_segment_states=True)
  c_out, c_final, c_grads = _clean_run(impl, chunk, per_segment_states=True)
  out, final, grads = _run(op, _inject(diff, cts, "initial_state", np.nan)[0], static, cts)
  s0, s1 = BOUNDS[1], BOUNDS[2]
  _all_nonfinite(out[0, s0:s1, 1], "segment 1 out")
  _all_nonfinite(final[0, 1, 1], "segment 1 final state")
  _all_nonfinite(grads["initial_state"][0, 1, 1], "segment 1 d_initial_state")
  for sl in (slice(0, s0), slice(s1, None)):
    _assert_same(out[0, sl], c_out[0, sl], f"out {sl}")
  for n in (0, 2):
    _assert_same(final[0, n], c_final[0, n], f"final state {n}")
    _assert_same(grads["initial_state"][0, n], c_grads["initial_state"][0, n], f"d_init {n}")
  _assert_same(out[1], c_out[1], "row 1")


@pytest.mark.parametrize("impl,chunk", [("reference", None), ("xla", 16)])
def test_overflowing_segment_does_not_reach_the_next_chunk(impl, chunk):
  """Finite inputs of an unstable recurrence (|k|^2 = 100, beta = 1, g = 0:
  the state grows 99x per token and overflows) in segment 0, which ends at a
  chunk boundary (32, at chunk 16): segment 1 starts from zeros selected in,
  not from the inf state multiplied by a zero decay (0 * inf = NaN), forward
  and backward. (Inside a chunk the matmuls still mix an overflowed
  segment's rows with zero coefficients: docs/gdn_math.md, "Segments".)"""
  t, cut = 48, 32
  r = np.random.default_rng(5)
  k = np.tile(r.standard_normal(8), (1, t, 1, 1))
  k = 10.0 * k / np.linalg.norm(k, axis=-1, keepdims=True)
  args = dict(query=r.standard_normal((1, t, 1, 8)), key=k, value=r.standard_normal((1, t, 1, 8)),
              g=np.zeros((1, t, 1)), beta=np.ones((1, t, 1)))
  args = {n: jnp.asarray(x, jnp.float32) for n, x in args.items()}
  args["key"] = args["key"].at[:, cut:].multiply(0.1)     # stable in segment 1
  seg = jnp.asarray((np.arange(t) >= cut)[None], jnp.int32)
  cot = jnp.asarray(r.standard_normal((1, t, 1, 8)), jnp.float32)

  def run(op, a, segment_ids):
    def loss(a):
      out, final = h.call(op, a, dict(segment_ids=segment_ids, output_final_state=True))
      return jnp.sum(out[:, -(t - cut):] * cot[:, -(t - cut):]) + jnp.sum(final), (out, final)
    with h.context(impl):
      return jax.jit(jax.grad(loss, has_aux=True))(a)

  grads, (out, final) = run(_op(impl, chunk), args, seg)
  assert not np.isfinite(np.asarray(out[0, cut - 1])).all()     # it did overflow
  alone = {n: x[:, cut:] for n, x in args.items()}
  want_grads, (want_out, want_final) = run("reference", alone, None)
  np.testing.assert_allclose(out[:, cut:], want_out, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(final, want_final, rtol=1e-4, atol=1e-5)
  for n in h.POSITIONAL:
    np.testing.assert_allclose(grads[n][:, cut:], want_grads[n], rtol=1e-3, atol=1e-5,
                               err_msg=n)


def _in_time_problem():
  diff, static = h.inputs(6, b=2, t=T_TIME, hk=HV // GROUP, hv=HV, dk=8, dv=8, gate=True)
  static.update(use_qk_l2norm=True)
  return diff, static, h.cotangents(diff, static, seed=7)


T_TIME = 40       # the bad token (BAD_TIME) in xla's second chunk of 16
BAD_TIME = 20
TIME_CASES = [("value", np.nan), ("key", np.inf), ("g", np.nan), ("d_out_after", np.nan)]


@pytest.mark.parametrize(
    "impl,chunk,name,value",
    [p for p in _params(TIME_CASES) if "pallas" not in p.id]
    + [pytest.param("pallas_mosaic_tpu", 64, "value", np.nan, id="pallas_mosaic_tpu-C64-value")])
def test_nan_does_not_flow_backwards_in_time(impl, chunk, name, value):
  """No segment_ids: a NaN / inf at token 20 leaves the outputs before it as
  in the clean run and their gradients finite ("d_out_after": the NaN
  cotangents a `where`-masked loss gets from outputs that are NaN already)."""
  op = _op(impl, chunk)
  diff, static, cts = _in_time_problem()
  c_out, _, _ = _run(op, diff, static, cts)
  diff, cts = dict(diff), list(cts)
  if name == "d_out_after":
    diff["value"] = diff["value"].at[0, BAD_TIME, 1, 2].set(np.nan)
    cts[0] = cts[0].at[0, BAD_TIME:, 1].set(value)
  elif name in ("key", "value"):      # key head 0 is read by value heads 0 and 1
    diff[name] = diff[name].at[0, BAD_TIME, 1 if name == "value" else 0, 2].set(value)
  else:
    diff[name] = diff[name].at[0, BAD_TIME, 1].set(value)
  out, final, grads = _run(op, diff, static, tuple(cts))
  _assert_same(out[:, :BAD_TIME], c_out[:, :BAD_TIME], "outputs before the bad token")
  _assert_same(out[1], c_out[1], "row 1")
  _all_nonfinite(out[0, BAD_TIME:, 1], "outputs from the bad token on")
  _all_nonfinite(final[0, 1], "final state")
  for n in h.POSITIONAL:
    h.assert_finite(grads[n][:, :BAD_TIME], f"d{n} before the bad token")
    h.assert_finite(grads[n][1], f"row 1 d{n}")
  _all_nonfinite(grads["beta"][0, BAD_TIME:, 1], "dbeta from the bad token on")
  h.assert_finite(grads["initial_state"], "d_initial_state")



@pytest.mark.parametrize("impl,chunk", _params())
def test_bad_value_poisons_its_segment_across_a_chunk_boundary(impl, chunk):
  """A NaN value at token 50 (segment 2, [45, 70)): value head 1's outputs
  NaN up to the row's end, across the chunk boundary at 64 (the Pallas
  kernels carry the flag from chunk to chunk), and its final state; the
  gradients from token 50 on NaN, before it finite; segments 0 and 1 as
  without it."""
  diff, static, cts = _problem()
  c_out, c_final, c_grads = _clean_run(impl, chunk)
  bad = dict(diff, value=diff["value"].at[0, 50, 1, 2].set(np.nan))
  out, final, grads = _run(_op(impl, chunk), bad, static, cts)
  s1 = BOUNDS[2]
  _all_nonfinite(out[0, 50:, 1], "head 1 out from token 50 on")
  _assert_same(out[0, :50], c_out[0, :50], "out before token 50")
  _all_nonfinite(final[0, 1], "head 1 final state")
  _assert_same(final[0, 0], c_final[0, 0], "head 0 final state")
  for n, head in (("value", 1), ("g", 1), ("beta", 1), ("query", 0), ("key", 0)):
    _all_nonfinite(grads[n][0, 50:, head], f"d{n} from token 50 on")
    h.assert_finite(grads[n][0, s1:50], f"d{n} of segment 2 before token 50")
  for n in h.POSITIONAL:
    _assert_same(grads[n][0, :s1], c_grads[n][0, :s1], f"d{n} of segments 0 and 1")


@pytest.mark.parametrize("impl,chunk", _params())
def test_beta_logits_nan_poisons_and_infinities_are_saturated_betas(impl, chunk):
  """`use_beta_sigmoid`: a NaN logit is a bad beta (its segment is
  poisoned, the others are untouched); ±inf logits are betas 1 and 0, not
  bad values: the results equal those of sigmoid(logits) passed as beta, and
  the logits' gradients are dbeta · beta (1 - beta) (0 at ±inf)."""
  op = _op(impl, chunk)
  diff, static = h.inputs(3, b=2, t=BOUNDS[-1], hk=HV // GROUP, hv=HV, dk=8, dv=8, gate=True,
                          beta_logits=True)
  seg = np.zeros((2, BOUNDS[-1]), np.int32)
  for i, start in enumerate(BOUNDS[1:-1]):
    seg[:, start:] = i + 1
  static.update(segment_ids=jnp.asarray(seg), use_qk_l2norm=True)
  cts = h.cotangents(diff, static, seed=4)
  # Saturated logits in segment 1, on both heads of key head 0.
  logits = diff["beta"].at[0, BAD_TOKEN, 1].set(np.inf).at[0, BAD_TOKEN + 3, 0].set(-np.inf)
  out, final, grads = _run(op, dict(diff, beta=logits), static, cts)
  probs = jax.nn.sigmoid(logits)
  p_out, p_final, p_grads = _run(op, dict(diff, beta=probs),
                                 dict(static, use_beta_sigmoid=False), cts)
  _assert_same(out, p_out, "out")
  _assert_same(final, p_final, "final")
  for n in ("query", "key", "value", "g", "initial_state", "a_log", "dt_bias"):
    _assert_same(grads[n], p_grads[n], f"d{n}")
  _assert_same(grads["beta"], p_grads["beta"] * probs * (1 - probs), "d logits")
  assert grads["beta"][0, BAD_TOKEN, 1] == 0 and grads["beta"][0, BAD_TOKEN + 3, 0] == 0
  # A NaN logit: as a NaN beta.
  out, final, grads = _run(op, dict(diff, beta=logits.at[0, BAD_TOKEN, 1].set(np.nan)),
                           static, cts)
  s1 = BOUNDS[2]
  _all_nonfinite(out[0, BAD_TOKEN:s1, 1], "out from the NaN logit on")
  _all_nonfinite(grads["beta"][0, BAD_TOKEN:s1, 1], "d logits from the NaN on")
  d_logits = p_grads["beta"] * probs * (1 - probs)
  for sl in (slice(0, BAD_TOKEN), slice(s1, None)):
    _assert_same(out[0, sl], p_out[0, sl], f"out {sl}")
    for n in ("query", "key", "value", "g"):
      _assert_same(grads[n][0, sl], p_grads[n][0, sl], f"d{n} {sl}")
    _assert_same(grads["beta"][0, sl], d_logits[0, sl], f"d logits {sl}")
  for n in ("value", "g", "query", "key"):
    _all_nonfinite(grads[n][0, BAD_TOKEN:s1, 1 if n in ("value", "g") else 0],
                   f"d{n} of the poisoned tokens")
  _assert_same(out[1], p_out[1], "row 1 out")
  _assert_same(final[0], p_final[0], "final (of the last segment)")
