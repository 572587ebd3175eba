"""`tokamax_gdn.chunk_gated_delta_rule` (FLA's interface): cu_seqlens equals the
segment_ids form, per-sequence states equal separate runs, FLA's defaults."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs
from tokamax_gdn.testing.specs import rel_rms, tolerance

# Four sequences packed in one row, one of them empty (FLA passes its state through).
CU = (0, 9, 9, 30, 37)
N = len(CU) - 1
T = CU[-1]
HK, HV, DK, DV = 1, 4, 8, 8


def _inputs(seed=0, t=T, b=1):
  (q, k, v, g, beta), _ = random_inputs(jax.random.key(seed), b=b, t=t, hk=HK, hv=HV,
                                        dk=DK, dv=DV, initial_state=False)
  h0 = 0.5 * jax.random.normal(jax.random.key(seed + 1), (N if b == 1 else b, HV, DK, DV))
  return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=h0)


def _cts(seed=3):
  a, b = jax.random.split(jax.random.key(seed))
  return jax.random.normal(a, (1, T, HV, DV)), jax.random.normal(b, (N, HV, DK, DV))


def _fwd_bwd(fn, d, cts):
  out, vjp = jax.vjp(fn, d)
  return out, vjp(cts)[0]


def _assert_close(got, want):
  for part, grad in ((0, False), (1, True)):
    tol = tolerance(jnp.float32, grad=grad)
    for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want[part]),
                            jax.tree.leaves(got[part])):
      err = rel_rms(g, w)
      assert err <= tol, f"{part}{jax.tree_util.keystr(path)}: rel-RMS {err:.2e} > {tol}"


def _fla(d, impl, **kw):
  d = dict(d)
  return tokamax_gdn.chunk_gated_delta_rule(
      d.pop("q"), d.pop("k"), d.pop("v"), d.pop("g"), d.pop("beta"), **d,
      output_final_state=True, use_qk_l2norm_in_kernel=True, implementation=impl, **kw)


def _per_segment_impls():
  """Every implementation: those with per-segment states are compared, the
  others must refuse with NotImplementedError (so `implementation=None` falls
  through to one that has them)."""
  return list(registry.implementations("gated_delta_rule"))


@pytest.mark.parametrize("impl", _per_segment_impls())
def test_cu_seqlens_equals_separate_runs(impl):
  op = registry.get("gated_delta_rule", impl)
  d = _inputs()
  if not type(op).supports_segment_states:
    with pytest.raises(NotImplementedError):
      _fla(d, impl, cu_seqlens=jnp.asarray(CU))
    return

  def packed(d):
    return _fla(d, impl, cu_seqlens=jnp.asarray(CU))

  def separate(d):
    outs, finals = [], []
    for i in range(N):
      lo, hi = CU[i], CU[i + 1]
      piece = {n: x[:, lo:hi] for n, x in d.items() if n != "initial_state"}
      o, f = _fla(dict(piece, initial_state=d["initial_state"][i:i + 1]), "reference")
      outs.append(o)
      finals.append(f)
    return jnp.concatenate(outs, axis=1), jnp.concatenate(finals, axis=0)

  with tokamax_gdn.config.interpret_mode(impl == "pallas_mosaic_tpu"):
    got = jax.jit(functools.partial(_fwd_bwd, packed))(d, _cts())
  want = jax.jit(functools.partial(_fwd_bwd, separate))(d, _cts())
  _assert_close(got, want)
  # The empty sequence's final state is its initial state; its gradient the cotangent.
  np.testing.assert_allclose(got[0][1][1], d["initial_state"][1], rtol=0, atol=0)
  np.testing.assert_allclose(got[1]["initial_state"][1], _cts()[1][1], rtol=1e-6)


def test_cu_seqlens_equals_segment_ids_form():
  """The per-sequence states through cu_seqlens = `gated_delta_rule` with
  segment_ids and [1, N, Hv, K, V] states (no empty sequence: run n = sequence n)."""
  cu = (0, 5, 21, 22, T)
  d = _inputs()
  ids = jnp.asarray(np.searchsorted(np.asarray(cu[1:-1]), np.arange(T), side="right"))[None]

  def segment_form(d):
    out, fin = tokamax_gdn.gated_delta_rule(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=d["initial_state"][None],
        segment_ids=ids, output_final_state=True, use_qk_l2norm=True,
        implementation="reference")
    return out, fin[0]

  got = jax.jit(functools.partial(
      _fwd_bwd, lambda d: _fla(d, "reference", cu_seqlens=jnp.asarray(cu))))(d, _cts())
  want = jax.jit(functools.partial(_fwd_bwd, segment_form))(d, _cts())
  _assert_close(got, want)


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_cu_seqlens_without_states_is_plain_segments(impl):
  """No state in or out: plain segment resets, so every implementation runs it."""
  d = _inputs()
  del d["initial_state"]
  ids = jnp.asarray(np.searchsorted(np.asarray(CU[1:-1]), np.arange(T), side="right"))[None]
  # Jitted (eager dispatch compiled ~340 programs for xla); cu_seqlens traced.
  got, fin = jax.jit(lambda d, cu: tokamax_gdn.chunk_gated_delta_rule(
      d["q"], d["k"], d["v"], d["g"], d["beta"], cu_seqlens=cu, implementation=impl))(
          d, jnp.asarray(CU))
  want, _ = jax.jit(lambda d: tokamax_gdn.gated_delta_rule(
      d["q"], d["k"], d["v"], d["g"], d["beta"], segment_ids=ids, implementation="reference"))(d)
  assert fin is None
  assert rel_rms(got, want) <= tolerance(jnp.float32, grad=False)


def test_without_cu_seqlens_is_gated_delta_rule_with_fla_defaults():
  """B rows, [B, Hv, K, V] states, scale K**-0.5, output in q's dtype; q, k
  and v of different dtypes (as FLA takes them) run in their common one."""
  d = _inputs(b=2)
  q, k, v, g, beta, h0 = (d[n] for n in ("q", "k", "v", "g", "beta", "initial_state"))
  q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
  got, fin = tokamax_gdn.chunk_gated_delta_rule(
      q, k, v, g, beta, initial_state=h0, output_final_state=True, implementation="reference")
  want, want_fin = tokamax_gdn.gated_delta_rule(
      q.astype(jnp.float32), k.astype(jnp.float32), v, g, beta, initial_state=h0,
      scale=DK**-0.5, output_final_state=True, implementation="reference")
  assert got.dtype == jnp.bfloat16 and fin.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(want.astype(jnp.bfloat16), np.float32))
  np.testing.assert_array_equal(fin, want_fin)


@pytest.mark.parametrize("bad, match", [
    (dict(cu_seqlens=(0, 5, T), batch=2), "batch size must be 1"),
    (dict(cu_seqlens=(1, 5, T)), "must start at 0"),
    (dict(cu_seqlens=(0, 5, T - 1)), "end at T"),
    (dict(cu_seqlens=(0, 20, 5, T)), "not decrease"),
    (dict(cu_seqlens=(0, 5, T), states=3), r"N = len\(cu_seqlens\) - 1 = 2"),
])
def test_bad_cu_seqlens(bad, match):
  d = _inputs(b=bad.get("batch", 1))
  h0 = jnp.zeros((bad.get("states", 2), HV, DK, DV))
  with pytest.raises(ValueError, match=match):
    tokamax_gdn.chunk_gated_delta_rule(
        d["q"], d["k"], d["v"], d["g"], d["beta"], initial_state=h0,
        output_final_state=True, cu_seqlens=jnp.asarray(bad["cu_seqlens"]),
        implementation="reference")


# ------------------------------------------- FLA's whole signature (keywords)
# The keywords are argument plumbing in front of the op, the same for every
# implementation: checked on the reference (the cheapest compile here).
KW_IMPL = "reference"


def _plain(d, impl=KW_IMPL, **kw):
  """tokamax_gdn.gated_delta_rule on B rows: the form each FLA keyword must equal."""
  return tokamax_gdn.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                      initial_state=d["initial_state"], output_final_state=True,
                                      use_qk_l2norm=True, implementation=impl, **kw)


def _b2():
  d = _inputs(b=2)
  cts = (jax.random.normal(jax.random.key(5), d["v"].shape),
         jax.random.normal(jax.random.key(6), d["initial_state"].shape))
  return d, cts


def _compare(fla_fn, plain_fn, d, cts):
  got = jax.jit(functools.partial(_fwd_bwd, fla_fn))(d, cts)
  want = jax.jit(functools.partial(_fwd_bwd, plain_fn))(d, cts)
  _assert_close(got, want)


def _call(d, *args, **kw):
  return tokamax_gdn.chunk_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], *args,
                                            implementation=KW_IMPL, **kw)


def test_fla_positional_order():
  """scale, initial_state, output_final_state, use_qk_l2norm_in_kernel (slot
  8) and cu_seqlens (slot 12) by position, as FLA's callers pass them."""
  d, cts = _b2()
  _compare(lambda d: _call(d, None, d["initial_state"], True, True), _plain, d, cts)
  one = _inputs()
  del one["initial_state"]
  got, _ = jax.jit(lambda d: _call(d, None, None, False, True, False, False, False,
                                   jnp.asarray(CU)))(one)
  want, _ = jax.jit(_fla_plain_segments)(one)
  assert rel_rms(got, want) <= tolerance(jnp.float32, grad=False)


def _fla_plain_segments(d):
  ids = jnp.asarray(np.searchsorted(np.asarray(CU[1:-1]), np.arange(T), side="right"))[None]
  return tokamax_gdn.gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"],
                                      segment_ids=ids, use_qk_l2norm=True, implementation=KW_IMPL)


def test_fla_use_gate_in_kernel():
  d, cts = _b2()
  d["a_log"] = jnp.log(jnp.linspace(0.5, 4.0, HV))
  d["dt_bias"] = jnp.linspace(-0.5, 0.5, HV)
  d["g"] = jax.random.normal(jax.random.key(8), d["g"].shape)     # the raw gate
  fla = lambda d: _call(d, initial_state=d["initial_state"], output_final_state=True,
                        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                        A_log=d["a_log"], dt_bias=d["dt_bias"])
  _compare(fla, lambda d: _plain(d, a_log=d["a_log"], dt_bias=d["dt_bias"]), d, cts)


@pytest.mark.parametrize("neg", [False, True])
def test_fla_beta_logits_and_negative_eigenvalues(neg):
  """beta as logits: sigmoid inside (2 sigmoid with allow_neg_eigval, beta in
  (0, 2)); gradients reach the logits as through the explicit form."""
  d, cts = _b2()
  d["beta"] = 3.0 * jax.random.normal(jax.random.key(9), d["beta"].shape)
  act = lambda b: (2.0 if neg else 1.0) * jax.nn.sigmoid(b)
  fla = lambda d: _call(d, initial_state=d["initial_state"], output_final_state=True,
                        use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                        allow_neg_eigval=neg)
  _compare(fla, lambda d: _plain(dict(d, beta=act(d["beta"]))), d, cts)


def test_negative_eigenvalues_stay_accurate():
  """beta in (0, 2) with unit keys (the transition's eigenvalues in (-1, 1]):
  xla against the per-token reference within the float32 contract, finite."""
  d, cts = _b2()
  d["beta"] = 2.0 * jax.nn.sigmoid(3.0 * jax.random.normal(jax.random.key(9), d["beta"].shape))
  _compare(functools.partial(_plain, impl="xla"), _plain, d, cts)


@pytest.mark.parametrize("name", ["state_v_first", "transpose_state_layout"])
def test_fla_state_v_first(name):
  """States [N, Hv, V, K] in and out (FLA's V-first layout; its old name too)."""
  d, cts = _b2()
  swap = lambda x: jnp.swapaxes(x, -1, -2)
  d["initial_state"] = swap(d["initial_state"])
  cts = (cts[0], swap(cts[1]))
  fla = lambda d: _call(d, initial_state=d["initial_state"], output_final_state=True,
                        use_qk_l2norm_in_kernel=True, **{name: True})

  def plain(d):
    out, final = _plain(dict(d, initial_state=swap(d["initial_state"])))
    return out, swap(final)

  _compare(fla, plain, d, cts)


def test_fla_chunk_size():
  d, _ = _b2()
  kw = dict(initial_state=d["initial_state"], output_final_state=True,
            use_qk_l2norm_in_kernel=True)
  got = jax.jit(lambda d: _call(d, chunk_size=32, **kw))(d)
  want = jax.jit(_plain)(d)
  for a, b in zip(got, want):
    assert rel_rms(a, b) <= tolerance(jnp.float32, grad=False)
  with pytest.raises(ValueError, match=r"\(16, 32, 64\)"):
    _call(d, chunk_size=48, **kw)


def test_fla_unknown_keyword_is_a_type_error_naming_it():
  d, _ = _b2()
  with pytest.raises(TypeError, match="use_kernel_gate"):
    _call(d, use_kernel_gate=True)
  with pytest.raises(NotImplementedError, match="context_parallel_axis"):
    _call(d, cp_context=object())
  with pytest.raises(ValueError, match="use_gate_in_kernel"):
    _call(d, A_log=jnp.zeros(HV))
  with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
    _call(d, allow_neg_eigval=True)
