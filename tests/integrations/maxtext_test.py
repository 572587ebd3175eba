"""`tokamax_gdn.integrations.maxtext.jax_chunk_gated_delta_rule` against MaxText's.

The oracle (`maxtext_oracle.py`) is written from the definition of MaxText
0.2.5's `jax_chunk_gated_delta_rule` (`maxtext/models/qwen3.py`), not copied:
maxtext is no dependency of this package. Forward and gradients (a VJP with
random cotangents on out and the final state), at DESIGN.md's contract:
float32 rel-RMS 2e-4 (outputs) / 2e-3 (gradients), bfloat16 2e-2. Small
shapes: T = 37 with MaxText's chunk of 16 (three chunks, the last partial),
GVA 1:2 with q/k repeated to the value heads (as MaxText passes them) and
not, an initial state.
"""

import contextlib
import functools
import io
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.integrations.maxtext_oracle import maxtext_chunk_gated_delta_rule as oracle
from tokamax_gdn import config
from tokamax_gdn.integrations import maxtext
from tokamax_gdn.testing.specs import rel_rms, tolerance

B, T, HK, HV, D, CHUNK = 2, 37, 1, 2, 16, 16


@functools.cache
def _problem(dtype, init=True):
  r = np.random.default_rng(0)
  n = lambda *s: r.standard_normal(s).astype(np.float32)
  cast = lambda x: jnp.asarray(x, dtype)
  q, k, v = cast(n(B, T, HK, D)), cast(n(B, T, HK, D)), cast(n(B, T, HV, D))
  g = cast(np.log(1 / (1 + np.exp(-(n(B, T, HV) + 3)))))         # log-sigmoid: in (-inf, 0)
  beta = cast(1 / (1 + np.exp(-n(B, T, HV))))
  s0 = jnp.asarray(0.1 * n(B, HV, D, D)) if init else None
  return q, k, v, g, beta, s0


def _vjp(fn, args, repeat):
  """(out, final), grads of <out, c1> + <final, c2> for fixed random c1, c2."""
  def f(q, k, v, g, beta, s0):
    if repeat:
      q, k = (jnp.repeat(x, HV // HK, axis=2) for x in (q, k))
    return fn(q, k, v, g, beta, s0)

  @jax.jit
  def run(args):
    outs, vjp = jax.vjp(f, *args)
    cts = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype), outs)
    return outs, vjp(cts)
  return run(args)


def _compare(got, want, dtype, what=""):
  (go, gs), gg = got
  (wo, ws), wg = want
  assert go.dtype == wo.dtype and go.shape == wo.shape, (go.dtype, wo.dtype, what)
  if ws is None:
    assert gs is None
  else:
    assert gs.dtype == ws.dtype and gs.shape == ws.shape, (gs.dtype, ws.dtype, what)
  for name, a, e, grad in [("out", go, wo, False), ("state", gs, ws, False)] + [
      (f"d{n}", a, e, True) for n, a, e in zip(("q", "k", "v", "g", "beta", "s0"), gg, wg)]:
    if e is None:
      continue
    err, tol = rel_rms(a, e), tolerance(dtype, grad=grad)
    assert err <= tol, f"{what} {name}: rel-RMS {err:.2e} > {tol:.0e}"


_want = functools.cache(lambda dtype, cd, norm, init: _vjp(
    functools.partial(_oracle, cd=cd, norm=norm), _problem(dtype, init), repeat=True))


def _oracle(q, k, v, g, beta, s0, *, cd, norm):
  return oracle(q, k, v, g, beta, CHUNK, s0, norm, cd)


def _ours(q, k, v, g, beta, s0, *, cd, norm, impl, **kwargs):
  return maxtext.jax_chunk_gated_delta_rule(q, k, v, g, beta, CHUNK, s0, norm, None, cd,
                                            implementation=impl, **kwargs)


@pytest.mark.parametrize("impl,dtype,cd,norm,repeat,init", [
    ("xla", jnp.float32, jnp.float32, True, True, True),
    ("xla", jnp.float32, jnp.float32, True, False, True),
    ("xla", jnp.float32, jnp.float32, False, False, True),
    ("xla", jnp.bfloat16, jnp.bfloat16, True, False, True),
    ("xla", jnp.float32, jnp.bfloat16, True, True, True),     # MaxText's default compute dtype
    ("xla", jnp.float32, jnp.float32, True, False, False),    # no initial state: no final state
    ("reference", jnp.float32, jnp.float32, True, False, True),
    ("pallas_mosaic_tpu", jnp.float32, jnp.float32, True, False, True),
])
def test_matches_maxtext(impl, dtype, cd, norm, repeat, init):
  want = _want(dtype, cd, norm, init)
  with config.interpret_mode(impl == "pallas_mosaic_tpu" and not config.on_tpu()):
    got = _vjp(functools.partial(_ours, cd=cd, norm=norm, impl=impl), _problem(dtype, init),
               repeat=repeat)
  # With compute_dtype bf16 the contract is bf16's, whatever the inputs' dtype.
  _compare(got, want, cd, f"{impl} {jnp.dtype(dtype).name}/{jnp.dtype(cd).name}")


def test_dtypes_and_layout_follow_maxtext():
  q, k, v, g, beta, s0 = _problem(jnp.float32)
  call = functools.partial(maxtext.jax_chunk_gated_delta_rule, implementation="xla")
  out, final = jax.eval_shape(lambda *a: call(*a, initial_state=s0), q, k,
                              v.astype(jnp.bfloat16), g, beta)
  assert out.dtype == jnp.float32 and out.shape == (B, T, HV, D)        # query's dtype
  assert final.dtype == jnp.bfloat16 and final.shape == (B, HV, D, D)  # compute_dtype
  out, final = jax.eval_shape(call, q, k, v, g, beta)
  assert final is None


def test_chunk_size_does_not_change_results():
  q, k, v, g, beta, s0 = _problem(jnp.float32)
  run = lambda c: jax.jit(lambda *a: maxtext.jax_chunk_gated_delta_rule(
      *a, c, s0, True, None, jnp.float32, implementation="xla"))(q, k, v, g, beta)
  (o1, s1), (o2, s2) = run(64), run(7)
  assert rel_rms(o1, o2) <= 2e-4 and rel_rms(s1, s2) <= 2e-4


@pytest.mark.parametrize("change,error,match", [
    (dict(query=jnp.zeros((B, T, HK, D + 1))), ValueError, "one shape"),
    (dict(query=jnp.zeros((B, T, 2, D)), key=jnp.zeros((B, T, 2, D)),
          value=jnp.zeros((B, T, 3, D))), ValueError, "multiple"),
    (dict(g=jnp.zeros((B, T, HK))), ValueError, r"g must be \[B, T, Hv\]"),
    (dict(beta=jnp.zeros((B, T + 1, HV))), ValueError, "beta"),
    (dict(query=jnp.zeros((B, T, D))), ValueError, r"\[B, T, H, D\]"),
    (dict(initial_state=jnp.zeros((B, HV, D, D + 1))), ValueError, "initial_state"),
    (dict(chunk_size=0), ValueError, "chunk_size"),
    (dict(chunk_size=16.0), ValueError, "chunk_size"),
    (dict(compute_dtype=jnp.int32), TypeError, "compute_dtype"),
    (dict(cp_axis=3), ValueError, "cp_axis"),
    (dict(key=jnp.zeros((B, T, HK, D), jnp.int32)), TypeError, "floating"),
    (dict(cp_axis="nowhere"), ValueError, "not a mesh axis"),
])
def test_bad_inputs_are_clear_errors(change, error, match):
  q, k, v, g, beta, _ = _problem(jnp.float32)
  args = dict(query=q, key=k, value=v, g=g, beta=beta)
  args.update(change)
  with pytest.raises(error, match=match):
    maxtext.jax_chunk_gated_delta_rule(**args, implementation="xla")


def _saved(policy, impl):
  """The residuals `jax.checkpoint(loss, policy)` saves (print_saved_residuals' lines)."""
  q, k, v, g, beta, s0 = _problem(jnp.float32)

  def loss(q, k, v, g, beta, s0):
    out, final = maxtext.jax_chunk_gated_delta_rule(
        jnp.sin(q), k, v, g, beta, CHUNK, s0, True, None, jnp.float32, implementation=impl)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(final)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf), config.interpret_mode(
      impl == "pallas_mosaic_tpu" and not config.on_tpu()):
    jax.ad_checkpoint.print_saved_residuals(jax.checkpoint(loss, policy=policy),
                                            q, k, v, g, beta, s0)
  return buf.getvalue()


def _names_in(text):
  return {n for n in maxtext.REMAT_GROUPS["gdn"] + maxtext.REMAT_GROUPS["gdn_conv"]
          if f"named '{n}'" in text}


@pytest.mark.parametrize("impl, expected", [
    # The Pallas forward emits chunk states and WY inverses; the XLA one no
    # states at one block's length (T = 37) and no inverses at all.
    ("pallas_mosaic_tpu", set(maxtext.REMAT_GROUPS["gdn"])),
    ("xla", set(maxtext.REMAT_GROUPS["gdn"]) - {"gdn_chunk_states", "gdn_t_inv"}),
])
def test_maxtext_remat_names_select_our_residuals(impl, expected):
  policies = jax.checkpoint_policies
  gdn = maxtext.REMAT_GROUPS["gdn"]
  # MaxText's `gdn: device`: all its names saved.
  saved = _saved(policies.save_only_these_names(*gdn), impl)
  assert _names_in(saved) == expected
  # `gdn: offload`: the same residuals, offloaded (listed as host copies, unnamed).
  offload = policies.save_and_offload_only_these_names(
      names_which_can_be_saved=[], names_which_can_be_offloaded=list(gdn),
      offload_src="device", offload_dst="pinned_host")
  offloaded = _saved(offload, impl)
  assert not _names_in(offloaded)
  assert offloaded.count("<host>") == saved.count("named '") > 0
  # One name alone keeps only its residual.
  assert _names_in(_saved(policies.save_only_these_names("gdn_core_attn_out"), impl)) == {
      "gdn_core_attn_out"}
  # `gdn: remat` (names not listed): nothing of ours saved, the inputs only.
  assert not _names_in(_saved(policies.nothing_saveable, impl))


def test_remat_name_tables_cover_maxtexts():
  every = set(maxtext.REMAT_GROUPS["gdn"]) | set(maxtext.REMAT_GROUPS["gdn_conv"])
  assert set(maxtext.MAXTEXT_NAMES.values()) | set(maxtext.UNMAPPED) == every
  assert not set(maxtext.MAXTEXT_NAMES.values()) & set(maxtext.UNMAPPED)


def test_gradients_under_a_maxtext_policy_match():
  """Saved residuals are used as given: gradients under `gdn: device` equal the oracle's."""
  q, k, v, g, beta, s0 = _problem(jnp.float32)
  policy = jax.checkpoint_policies.save_only_these_names(*maxtext.REMAT_GROUPS["gdn"])

  def loss(fn):
    return lambda *a: (lambda o, s: jnp.sum(o ** 2) + jnp.sum(s))(*fn(*a))
  ours = functools.partial(_ours, cd=jnp.float32, norm=True, impl="xla")
  rep = lambda x: jnp.repeat(x, HV // HK, axis=2)
  ref = lambda q, k, *a: _oracle(rep(q), rep(k), *a, cd=jnp.float32, norm=True)
  got = jax.jit(jax.grad(jax.checkpoint(loss(ours), policy=policy), argnums=range(6)))(
      q, k, v, g, beta, s0)
  want = jax.jit(jax.grad(loss(ref), argnums=range(6)))(q, k, v, g, beta, s0)
  for a, e in zip(got, want):
    assert rel_rms(a, e) <= 2e-3


def test_context_parallel_matches_maxtext(tmp_path_factory):
  """`cp_axis` (a name, and MaxText's tuple of two live axes) inside
  `jax.shard_map` over 4 host devices, in a subprocess (maxtext_cp_checks.py)."""
  from tests.multidevice import runner  # pylint: disable=g-import-not-at-top
  script = runner.HERE.parent / "integrations" / "maxtext_cp_checks.py"
  runner.check_group("maxtext_cp", tmp_path_factory, script, host_devices=4, timeout=600)
