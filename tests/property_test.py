"""Property tests: every fast gated-delta-rule implementation equals `reference`
(forward, final state and all gradients) over random problem layouts drawn by
hypothesis: batch, time, key heads, GVA ratio, head dims, chunk size, dtype,
segment layout, L2 norm, gate parameters and initial state.

Derandomised (fixed examples, no example database) so CI is stable; few
examples, tiny shapes. `pallas_mosaic_tpu` runs in interpret mode off TPU on
even smaller shapes.
"""

import dataclasses

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.testing import conformance as conf
from tokamax_gdn.testing.specs import rel_rms, tolerance

OP = "gated_delta_rule"
SEGMENT_LAYOUTS = ("none", "random", "chunk_aligned", "every_token", "last_token_alone")

SETTINGS = dict(deadline=None, derandomize=True, database=None, print_blob=True,
                suppress_health_check=list(hypothesis.HealthCheck))


@st.composite
def problems(draw, *, max_t, max_b):
  hk = draw(st.sampled_from([1, 2]))
  return dict(
      b=draw(st.integers(1, max_b)),
      t=draw(st.integers(1, max_t)),
      hk=hk,
      ratio=draw(st.sampled_from([1, 2, 4])),
      dk=draw(st.sampled_from([8, 16, 32])),
      dv=draw(st.sampled_from([8, 16, 32])),
      chunk=draw(st.sampled_from([16, 32, 64])),
      dtype=draw(st.sampled_from(["float32", "bfloat16"])),
      segments=draw(st.sampled_from(SEGMENT_LAYOUTS)),
      l2norm=draw(st.booleans()),
      gate_params=draw(st.booleans()),
      initial_state=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
  )


def _segment_ids(layout, b, t, chunk, r):
  if layout == "none":
    return None
  if layout == "random":
    cuts = r.uniform(size=(b, t)) < 0.15
  elif layout == "chunk_aligned":
    cuts = np.broadcast_to((np.arange(t) % chunk) == 0, (b, t))
  elif layout == "every_token":
    cuts = np.ones((b, t), bool)
  else:                                        # last token is its own segment
    cuts = np.zeros((b, t), bool)
    cuts[:, -1] = True
  return jnp.asarray(np.cumsum(cuts, axis=1), jnp.int32)


def _inputs(p):
  r = np.random.default_rng(p["seed"])
  b, t, hk, dk, dv = p["b"], p["t"], p["hk"], p["dk"], p["dv"]
  hv = hk * p["ratio"]
  normal = lambda *s: r.standard_normal(s).astype(np.float32)
  dt = jnp.dtype(p["dtype"])
  k = normal(b, t, hk, dk)
  if not p["l2norm"]:
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
  args = dict(query=normal(b, t, hk, dk), key=k, value=normal(b, t, hv, dv),
              beta=1 / (1 + np.exp(-normal(b, t, hv))))
  if p["gate_params"]:
    args["g"] = normal(b, t, hv)
    args["a_log"] = 0.5 * normal(hv)
    args["dt_bias"] = 0.5 * normal(hv)
  else:
    args["g"] = -np.logaddexp(0, normal(b, t, hv))
  args = {n: jnp.asarray(x, dt if n not in ("a_log", "dt_bias") else jnp.float32)
          for n, x in args.items()}
  if p["initial_state"]:
    args["initial_state"] = jnp.asarray(0.2 * normal(b, hv, dk, dv))
  static = dict(use_qk_l2norm=p["l2norm"], output_final_state=True,
                segment_ids=_segment_ids(p["segments"], b, t, p["chunk"], r))
  return args, static


def _with_chunk(impl_name, chunk):
  """The registered Op with its chunk size set (forward and VJP op)."""
  impl = registry.get(OP, impl_name)
  cfg_cls = getattr(type(impl), "config_cls", None)
  if cfg_cls is None or "chunk_size" not in getattr(cfg_cls, "__dataclass_fields__", {}):
    return impl
  try:
    cfg = cfg_cls(chunk_size=chunk)
  except Exception:  # pylint: disable=broad-except  (chunk not offered by this impl)
    cfg = cfg_cls(chunk_size=max(chunk, 32))
  vjp = impl.vjp
  if dataclasses.is_dataclass(vjp) and getattr(type(vjp), "config_cls", None) is cfg_cls:
    vjp = dataclasses.replace(vjp, config=cfg)
  return dataclasses.replace(impl, config=cfg, vjp=vjp)


def _fwd_bwd(impl, args, static, cts):
  def f(a):
    a = dict(a)
    pos = [a.pop(n) for n in ("query", "key", "value", "g", "beta")]
    return gated_delta_rule(*pos, **a, **static, implementation=impl)

  @jax.jit
  def run(a):
    out, vjp = jax.vjp(f, a)
    return out, vjp(cts)[0]

  return run(args)


def _check(impl_name, p):
  args, static = _inputs(p)
  b, t, hv, dv = p["b"], p["t"], p["hk"] * p["ratio"], p["dv"]
  r = np.random.default_rng(p["seed"] + 1)
  cts = (jnp.asarray(r.standard_normal((b, t, hv, dv)), args["value"].dtype),
         jnp.asarray(r.standard_normal((b, hv, p["dk"], dv)), jnp.float32))
  impl = _with_chunk(impl_name, p["chunk"])
  with conf.execution_context(impl_name):
    (out, fin), grads = _fwd_bwd(impl, args, static, cts)
  (r_out, r_fin), r_grads = _fwd_bwd("reference", args, static, cts)
  tol_f = tolerance(p["dtype"], grad=False)
  tol_g = tolerance(p["dtype"], grad=True)
  errs = {"out": (rel_rms(out, r_out), tol_f), "final_state": (rel_rms(fin, r_fin), tol_f)}
  for n in r_grads:
    errs[f"d{n}"] = (rel_rms(grads[n], r_grads[n]), tol_g)
  for n, x in [("out", out), ("final_state", fin), *grads.items()]:
    assert np.isfinite(np.asarray(jnp.asarray(x, jnp.float32))).all(), f"{n} not finite: {p}"
  bad = {n: e for n, e in errs.items() if not e[0] <= e[1]}
  assert not bad, f"{impl_name} vs reference over tolerance {bad} for {p}"
  assert out.dtype == args["value"].dtype and fin.dtype == jnp.float32


def _impl(name):
  if name not in registry.implementations(OP):
    return pytest.param(name, marks=pytest.mark.skip(reason=f"{name} not registered"))
  return name


@pytest.mark.parametrize("impl_name", [_impl("xla")])
@hypothesis.settings(max_examples=10, **SETTINGS)
@hypothesis.given(p=problems(max_t=80, max_b=2))
@hypothesis.example(p=dict(b=1, t=33, hk=1, ratio=4, dk=16, dv=16, chunk=16, dtype="float32",
                           segments="chunk_aligned", l2norm=True, gate_params=True,
                           initial_state=True, seed=1))
def test_xla_matches_reference(impl_name, p):
  _check(impl_name, p)


@pytest.mark.parametrize("impl_name", [_impl("pallas_mosaic_tpu")])
@hypothesis.settings(max_examples=5, **SETTINGS)
@hypothesis.given(p=problems(max_t=40, max_b=1))
def test_pallas_mosaic_tpu_matches_reference(impl_name, p):
  if not config.on_tpu():
    p = dict(p, dk=min(p["dk"], 16), dv=min(p["dv"], 16))   # interpret mode: keep it tiny
  _check(impl_name, p)


def test_every_fast_implementation_is_property_tested():
  """A new implementation must get a property test here."""
  covered = {"reference", "xla", "pallas_mosaic_tpu"}
  assert set(registry.implementations(OP)) <= covered, (
      f"add a property test for {set(registry.implementations(OP)) - covered}")
