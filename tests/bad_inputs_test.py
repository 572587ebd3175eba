"""Bad inputs: every op, every registered implementation, through the public API.

Wrong shapes / ranks raise ValueError and wrong dtypes TypeError, naming the
argument, before any kernel runs (each implementation's `_fwd` is replaced by a
tripwire while the call is made). NaN / inf in inputs propagate to outputs
without crashing. `implementation=` resolution errors are clear.
"""

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d import base as conv_base
from tokamax_gdn.ops.causal_conv1d.api import causal_conv1d
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.api import causal_conv1d_gated_delta_rule
from tokamax_gdn.ops.gated_delta_rule import base as gdn_base
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.ops.gated_rmsnorm.api import gated_rmsnorm
from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.tgmm.api import tgmm
from tokamax_gdn.testing import conformance as conf

f32, bf16, i32 = jnp.float32, jnp.bfloat16, jnp.int32
API = {"gated_delta_rule": gated_delta_rule, "causal_conv1d": causal_conv1d,
       "gmm": gmm, "tgmm": tgmm, "causal_conv1d_gated_delta_rule": causal_conv1d_gated_delta_rule,
       "gated_rmsnorm": gated_rmsnorm}


def z(shape, dtype=f32):
  return jnp.full(shape, 0.5, dtype) if jnp.issubdtype(dtype, jnp.floating) else (
      jnp.ones(shape, dtype))


# ---------------------------------------------------------------- good inputs
B, T, HK, HV, DK, DV = 1, 8, 2, 4, 8, 8
D, W = 6, 4
M, K, N, G = 8, 4, 3, 2


def gdn_good():
  args = dict(query=z((B, T, HK, DK)), key=z((B, T, HK, DK)), value=z((B, T, HV, DV)),
              g=-z((B, T, HV)), beta=z((B, T, HV)))
  kw = dict(initial_state=z((B, HV, DK, DV)), a_log=z((HV,)), dt_bias=z((HV,)),
            segment_ids=jnp.zeros((B, T), i32), output_final_state=True)
  return args, kw


def conv_good():
  return dict(x=z((B, T, D)), weight=z((D, W)), bias=z((D,))), dict(
      initial_state=z((B, W - 1, D)), segment_ids=jnp.zeros((B, T), i32),
      output_final_state=True)


def gmm_good():
  return dict(lhs=z((M, K)), rhs=z((G, K, N)), group_sizes=jnp.array([3, 4], i32)), {}


def tgmm_good():
  return dict(lhs=z((M, K)), rhs=z((M, N)), group_sizes=jnp.array([3, 4], i32)), {}


SERVE_DIM = 2 * HK * DK + HV * DV
SERVE = dict(n_kq=HK, n_v=HV, d_k=DK, d_v=DV, kernel_size=W)


def serve_good():
  """One prefill request of T tokens in slot 1 of a 2-slot pool."""
  return dict(qkv=z((T, SERVE_DIM)), b=z((T, HV)), a=z((T, HV)),
              conv_state=z((2, W - 1, SERVE_DIM)), recurrent_state=z((2, HV, DK, DV)),
              conv_weight=z((SERVE_DIM, 1, W)), conv_bias=z((SERVE_DIM,)), a_log=z((HV,)),
              dt_bias=z((HV,)), query_start_loc=jnp.array([0, T], i32),
              state_indices=jnp.array([1], i32), distribution=jnp.array([0, 1, 1], i32),
              seq_lens=jnp.array([T], i32)), dict(SERVE)


def norm_good():
  return dict(x=z((B, T, HV, DV)), gate=z((B, T, HV, DV)), weight=z((DV,))), dict(eps=1e-6)


GOOD = {"gated_delta_rule": gdn_good, "causal_conv1d": conv_good, "gmm": gmm_good,
        "tgmm": tgmm_good, "causal_conv1d_gated_delta_rule": serve_good,
        "gated_rmsnorm": norm_good}
POSITIONAL = {"gated_delta_rule": ("query", "key", "value", "g", "beta"),
              "causal_conv1d": ("x", "weight", "bias"),
              "gmm": ("lhs", "rhs", "group_sizes"),
              "tgmm": ("lhs", "rhs", "group_sizes"),
              "causal_conv1d_gated_delta_rule": (
                  "qkv", "b", "a", "conv_state", "recurrent_state", "conv_weight", "conv_bias",
                  "a_log", "dt_bias", "query_start_loc", "state_indices", "distribution",
                  "seq_lens"),
              "gated_rmsnorm": ("x", "gate", "weight")}

# (op, case id, argument named in the error, exception, replacement kwargs)
BAD = [
    # gated_delta_rule
    ("gated_delta_rule", "query_rank3", "query", ValueError, dict(query=z((B, T, HK * DK)))),
    ("gated_delta_rule", "query_int", "query", TypeError, dict(query=z((B, T, HK, DK), i32))),
    ("gated_delta_rule", "key_shape", "key", ValueError, dict(key=z((B, T, HK, DK + 1)))),
    ("gated_delta_rule", "key_rank5", "key", ValueError, dict(key=z((B, T, HK, DK, 1)))),
    ("gated_delta_rule", "key_int", "key", TypeError, dict(key=z((B, T, HK, DK), i32))),
    ("gated_delta_rule", "value_time", "value", ValueError, dict(value=z((B, T + 1, HV, DV)))),
    ("gated_delta_rule", "value_heads_not_multiple", "value", ValueError,
     dict(value=z((B, T, HV + 1, DV)))),
    ("gated_delta_rule", "value_rank3", "value", ValueError, dict(value=z((B, T, HV * DV)))),
    ("gated_delta_rule", "value_int", "value", TypeError, dict(value=z((B, T, HV, DV), i32))),
    ("gated_delta_rule", "g_key_heads", "g", ValueError, dict(g=z((B, T, HK)))),
    ("gated_delta_rule", "g_rank4", "g", ValueError, dict(g=z((B, T, HV, 1)))),
    ("gated_delta_rule", "g_int", "g", TypeError, dict(g=z((B, T, HV), i32))),
    ("gated_delta_rule", "beta_shape", "beta", ValueError, dict(beta=z((B, T - 1, HV)))),
    ("gated_delta_rule", "beta_bool", "beta", TypeError, dict(beta=z((B, T, HV), jnp.bool_))),
    ("gated_delta_rule", "state_shape", "initial_state", ValueError,
     dict(initial_state=z((B, HV, DV + 1, DK)))),
    ("gated_delta_rule", "state_int", "initial_state", TypeError,
     dict(initial_state=z((B, HV, DK, DV), i32))),
    ("gated_delta_rule", "a_log_shape", "a_log", ValueError, dict(a_log=z((HK,)))),
    ("gated_delta_rule", "a_log_int", "a_log", TypeError, dict(a_log=z((HV,), i32))),
    ("gated_delta_rule", "dt_bias_shape", "dt_bias", ValueError, dict(dt_bias=z((1, HV)))),
    ("gated_delta_rule", "dt_bias_without_a_log", "dt_bias", ValueError, dict(a_log=None)),
    ("gated_delta_rule", "segment_ids_shape", "segment_ids", ValueError,
     dict(segment_ids=jnp.zeros((B, T + 1), i32))),
    ("gated_delta_rule", "segment_ids_float", "segment_ids", TypeError,
     dict(segment_ids=z((B, T)))),
    # causal_conv1d
    ("causal_conv1d", "x_rank2", "x", ValueError, dict(x=z((T, D)))),
    ("causal_conv1d", "x_int", "x", TypeError, dict(x=z((B, T, D), i32))),
    ("causal_conv1d", "weight_channels", "weight", ValueError, dict(weight=z((D + 1, W)))),
    ("causal_conv1d", "weight_hf_layout_rank3", "weight", ValueError, dict(weight=z((D, 1, W)))),
    ("causal_conv1d", "weight_transposed", "weight", ValueError, dict(weight=z((W, D)))),
    ("causal_conv1d", "weight_width0", "weight", ValueError, dict(weight=z((D, 0)))),
    ("causal_conv1d", "weight_int", "weight", TypeError, dict(weight=z((D, W), i32))),
    ("causal_conv1d", "bias_shape", "bias", ValueError, dict(bias=z((D + 1,)))),
    ("causal_conv1d", "bias_int", "bias", TypeError, dict(bias=z((D,), i32))),
    ("causal_conv1d", "state_width", "initial_state", ValueError,
     dict(initial_state=z((B, W, D)))),
    ("causal_conv1d", "state_int", "initial_state", TypeError,
     dict(initial_state=z((B, W - 1, D), i32))),
    ("causal_conv1d", "segment_ids_shape", "segment_ids", ValueError,
     dict(segment_ids=jnp.zeros((B,), i32))),
    ("causal_conv1d", "segment_ids_float", "segment_ids", TypeError,
     dict(segment_ids=z((B, T)))),
    ("causal_conv1d", "activation_relu", "activation", ValueError, dict(activation="relu")),
    # gmm
    ("gmm", "lhs_rank3", "lhs", ValueError, dict(lhs=z((1, M, K)))),
    ("gmm", "lhs_int32", "lhs", TypeError, dict(lhs=z((M, K), i32))),
    ("gmm", "rhs_rank2", "rhs", ValueError, dict(rhs=z((K, N)))),
    ("gmm", "rhs_contraction", "rhs", ValueError, dict(rhs=z((G, K + 1, N)))),
    ("gmm", "rhs_transposed_layout", "rhs", ValueError, dict(transpose_rhs=True)),
    ("gmm", "rhs_bool", "rhs", TypeError, dict(rhs=z((G, K, N), jnp.bool_))),
    ("gmm", "group_sizes_len", "group_sizes", ValueError,
     dict(group_sizes=jnp.array([1, 2, 3], i32))),
    ("gmm", "group_sizes_rank2", "group_sizes", ValueError,
     dict(group_sizes=jnp.array([[3, 4]], i32))),
    ("gmm", "group_sizes_float", "group_sizes", TypeError,
     dict(group_sizes=jnp.array([3.0, 4.0]))),
    # tgmm
    ("tgmm", "lhs_rank1", "lhs", ValueError, dict(lhs=z((M,)))),
    ("tgmm", "lhs_int32", "lhs", TypeError, dict(lhs=z((M, K), i32))),
    ("tgmm", "rhs_rank3", "rhs", ValueError, dict(rhs=z((G, M, N)))),
    ("tgmm", "rhs_rows", "rhs", ValueError, dict(rhs=z((M + 1, N)))),
    ("tgmm", "rhs_int32", "rhs", TypeError, dict(rhs=z((M, N), i32))),
    ("tgmm", "group_sizes_rank0", "group_sizes", ValueError,
     dict(group_sizes=jnp.array(7, i32))),
    ("tgmm", "group_sizes_float", "group_sizes", TypeError,
     dict(group_sizes=jnp.array([3.0, 4.0]))),
    # causal_conv1d_gated_delta_rule (its own test_base covers more)
    ("causal_conv1d_gated_delta_rule", "qkv_dim", "qkv", ValueError,
     dict(qkv=z((T, SERVE_DIM + 1)))),
    ("causal_conv1d_gated_delta_rule", "qkv_int", "qkv", TypeError,
     dict(qkv=z((T, SERVE_DIM), i32))),
    ("causal_conv1d_gated_delta_rule", "b_tokens", "b", ValueError, dict(b=z((T + 1, HV)))),
    ("causal_conv1d_gated_delta_rule", "pool_fp16", "recurrent_state", TypeError,
     dict(recurrent_state=z((2, HV, DK, DV), jnp.float16))),
    ("causal_conv1d_gated_delta_rule", "conv_state_slots", "conv_state", ValueError,
     dict(conv_state=z((3, W - 1, SERVE_DIM)))),
    ("causal_conv1d_gated_delta_rule", "conv_weight_2d", "conv_weight", ValueError,
     dict(conv_weight=z((SERVE_DIM, W)))),
    ("causal_conv1d_gated_delta_rule", "heads_not_multiple", "n_v", ValueError,
     dict(n_kq=3)),
    ("causal_conv1d_gated_delta_rule", "query_start_loc_len", "query_start_loc", ValueError,
     dict(query_start_loc=jnp.array([0, T, T], i32))),
    ("causal_conv1d_gated_delta_rule", "state_indices_float", "state_indices", TypeError,
     dict(state_indices=jnp.array([1.0]))),
    # gated_rmsnorm
    ("gated_rmsnorm", "x_int", "x", TypeError, dict(x=z((B, T, HV, DV), i32))),
    ("gated_rmsnorm", "x_scalar", "x", ValueError, dict(x=z(()))),
    ("gated_rmsnorm", "gate_shape", "gate", ValueError, dict(gate=z((B, T, HV, DV + 1)))),
    ("gated_rmsnorm", "gate_bool", "gate", TypeError, dict(gate=z((B, T, HV, DV), jnp.bool_))),
    ("gated_rmsnorm", "weight_shape", "weight", ValueError, dict(weight=z((HV, DV)))),
    ("gated_rmsnorm", "weight_int", "weight", TypeError, dict(weight=z((DV,), i32))),
    ("gated_rmsnorm", "eps_zero", "eps", ValueError, dict(eps=0.0)),
    ("causal_conv1d_gated_delta_rule", "slot_out_of_pool", "state_indices", ValueError,
     dict(state_indices=jnp.array([2], i32))),
    ("causal_conv1d_gated_delta_rule", "spec_without_offsets", "read_offsets", ValueError,
     dict(num_spec_tokens=1)),
]


def _impl_cases():
  return [pytest.param(op, name, id=f"{op}-{name}")
          for op in registry.list_ops() for name in registry.implementations(op)]


def _bad_cases():
  out = []
  for op_name, case_id, argname, exc, repl in BAD:
    for impl_name in registry.implementations(op_name):
      out.append(pytest.param(op_name, impl_name, argname, exc, repl,
                              id=f"{op_name}-{impl_name}-{case_id}"))
  return out


class _KernelRan(Exception):
  pass


@pytest.fixture
def tripwire(monkeypatch):
  """Makes `_fwd` of every registered implementation raise `_KernelRan`."""

  for op_name in registry.list_ops():
    for impl in registry.implementations(op_name).values():
      original = type(impl)._fwd

      @functools.wraps(original)  # keeps the signature `Op.bind` inspects
      def boom(self, *a, **k):
        raise _KernelRan(f"{type(self).__name__}._fwd ran before validation")

      monkeypatch.setattr(type(impl), "_fwd", boom)


def _call(op_name, impl_name, args, kw):
  pos = [args[n] for n in POSITIONAL[op_name]]
  with conf.execution_context(impl_name):
    return API[op_name](*pos, **kw, implementation=impl_name)


def _jitted(op_name, impl_name, static):
  """The op under jit, called as f(positional list, array keywords): one
  compile (eager dispatch compiles every primitive of the chunked algebra and
  interpret-mode glue on its own), reused for every input of those shapes."""
  return jax.jit(lambda p, a: API[op_name](*p, **a, **static, implementation=impl_name))


def _merge(op_name, repl):
  args, kw = GOOD[op_name]()
  for name, x in repl.items():
    (args if name in args else kw)[name] = x
  return args, kw


@pytest.mark.parametrize("op_name,impl_name,argname,exc,repl", _bad_cases())
def test_bad_input_raises_naming_argument(tripwire, op_name, impl_name, argname, exc, repl):
  del tripwire
  args, kw = _merge(op_name, repl)
  with pytest.raises(exc) as info:
    _call(op_name, impl_name, args, kw)
  msg = str(info.value)
  assert re.search(rf"(`{argname}`|\b{argname}\b)", msg), (
      f"{type(info.value).__name__} does not name `{argname}`: {msg}")


@pytest.mark.parametrize("op_name,impl_name", _impl_cases())
def test_tripwire_sees_good_inputs(tripwire, op_name, impl_name):
  """Sanity check of the harness: good inputs do reach `_fwd`."""
  del tripwire
  args, kw = GOOD[op_name]()
  with pytest.raises(_KernelRan):
    _call(op_name, impl_name, args, kw)


@pytest.mark.parametrize("op_name,impl_name", _impl_cases())
def test_bad_input_raises_under_jit_trace(op_name, impl_name):
  """Errors come at trace time (shape checks are static), also under jit."""
  args, kw = _merge(op_name, {"gated_delta_rule": dict(g=z((B, T, HK))),
                              "causal_conv1d": dict(bias=z((D + 1,))),
                              "gmm": dict(rhs=z((G, K + 1, N))),
                              "tgmm": dict(rhs=z((M + 1, N))),
                              "causal_conv1d_gated_delta_rule": dict(b=z((T + 1, HV))),
                              "gated_rmsnorm": dict(weight=z((DV + 1,))),
                              }[op_name])
  arrays = {n: x for n, x in {**args, **kw}.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in {**args, **kw}.items() if n not in arrays}

  def f(arrays):
    full = {**arrays, **static}
    a = {n: full.pop(n) for n in POSITIONAL[op_name]}
    return _call(op_name, impl_name, a, full)

  with pytest.raises(ValueError):
    jax.eval_shape(f, arrays)


# ------------------------------------------------------------- group sizes
@pytest.mark.parametrize("op_name", ["gmm", "tgmm"])
@pytest.mark.parametrize("sizes", [[-1, 4], [5, 6]], ids=["negative", "sum_gt_M"])
def test_bad_group_sizes_opt_in_check(op_name, sizes):
  from jax.experimental import checkify  # pylint: disable=g-import-not-at-top
  offered = [n for n, impl in registry.implementations(op_name).items()
             if dataclasses.is_dataclass(impl)
             and "checkify_group_sizes" in {f.name for f in dataclasses.fields(impl)}]
  # tokamax.ragged_dot has such a check: every implementation offers it.
  assert offered == list(registry.implementations(op_name)), offered
  for name in offered:
    impl = dataclasses.replace(registry.get(op_name, name), checkify_group_sizes=True)
    args, _ = GOOD[op_name]()
    args["group_sizes"] = jnp.array(sizes, i32)
    fn = jax.jit(checkify.checkify(lambda a: impl(a["lhs"], a["rhs"], a["group_sizes"])))
    with conf.execution_context(name):
      err, _ = fn(args)
    with pytest.raises(checkify.JaxRuntimeError, match="group_sizes"):
      err.throw()
    # Valid sizes pass the same check.
    args["group_sizes"] = jnp.array([1, 2], i32)
    with conf.execution_context(name):
      err, _ = fn(args)
    err.throw()


def _gmm_impl_cases():
  return [pytest.param(op, name, id=f"{op}-{name}")
          for op in ("gmm", "tgmm") for name in registry.implementations(op)]


@pytest.mark.parametrize("sizes", [[-1, 4], [5, 6], [-3, 20]],
                         ids=["negative", "sum_gt_M", "both"])
@pytest.mark.parametrize("op_name,impl_name", _gmm_impl_cases())
def test_invalid_group_sizes_do_not_crash(op_name, impl_name, sizes):
  """Without a check, invalid sizes are garbage in, but must not crash, hang or
  read out of bounds into NaN: a finite result of the right shape."""
  args, kw = GOOD[op_name]()
  args["group_sizes"] = jnp.array(sizes, i32)
  out = np.asarray(_call(op_name, impl_name, args, kw))
  assert out.shape == ((M, N) if op_name == "gmm" else (G, K, N))
  assert np.isfinite(out).all()


# ------------------------------------------------------------------ NaN / inf
def _poison(op_name, which, value):
  args, kw = GOOD[op_name]()
  if op_name == "gated_delta_rule":
    kw.pop("segment_ids")
    name = {"nan": "value", "inf": "query"}[which]
    args[name] = args[name].at[0, 3].set(value)
  elif op_name == "causal_conv1d":
    args["x"] = args["x"].at[0, 3, 1].set(value)
  elif op_name == "causal_conv1d_gated_delta_rule":
    args["qkv"] = args["qkv"].at[3, 1].set(value)
  elif op_name == "gated_rmsnorm":
    args["x"] = args["x"].at[0, 3, 1, 2].set(value)
  else:
    args["lhs"] = args["lhs"].at[1, 0].set(value)
  return args, kw


@pytest.mark.parametrize("op_name,impl_name", _impl_cases())
def test_nan_inf_propagate(op_name, impl_name):
  """A NaN and an inf input (one compiled program, called on both) reach the
  output."""
  static = {k: v for k, v in GOOD[op_name]()[1].items() if not hasattr(v, "shape")}
  call = _jitted(op_name, impl_name, static)
  for which in ("nan", "inf"):
    args, kw = _poison(op_name, which, jnp.nan if which == "nan" else jnp.inf)
    pos = [args[n] for n in POSITIONAL[op_name]]
    with conf.execution_context(impl_name):
      out = call(pos, {k: v for k, v in kw.items() if hasattr(v, "shape")})
    if op_name == "causal_conv1d_gated_delta_rule":   # ((pools), out)
      out = out[1]
    out = out[0] if isinstance(out, tuple) else out
    out = np.asarray(jax.block_until_ready(out), np.float32)
    assert not np.isfinite(out).all(), f"{op_name}/{impl_name}: {which} input vanished"
    if op_name in ("gated_delta_rule", "causal_conv1d"):
      # Causal: tokens before the poisoned one (t=3) stay finite only for exact
      # per-token implementations; chunked ones may mix a chunk. Never all NaN
      # before the poison in the reference.
      if impl_name == "reference":
        assert np.isfinite(out[:, :3]).all(), which


# -------------------------------------------------------- implementation=
@pytest.mark.parametrize("op_name", registry.list_ops())
def test_unknown_implementation_lists_valid_names(op_name):
  args, kw = GOOD[op_name]()
  pos = [args[n] for n in POSITIONAL[op_name]]
  with pytest.raises(ValueError) as info:
    API[op_name](*pos, **kw, implementation="triton")
  msg = str(info.value)
  assert "triton" in msg
  for name in registry.implementations(op_name):
    assert name in msg, msg
  with pytest.raises(ValueError):
    API[op_name](*pos, **kw, implementation=["xla", "no_such_impl"])


@pytest.mark.parametrize("op_name", registry.list_ops())
def test_empty_implementation_sequence(op_name):
  args, kw = GOOD[op_name]()
  pos = [args[n] for n in POSITIONAL[op_name]]
  for empty in ([], ()):
    with pytest.raises(ValueError, match="implementation"):
      API[op_name](*pos, **kw, implementation=empty)


def _unsupported_gdn():
  impl = registry.get("gated_delta_rule", "reference")
  cls = type("TinyHeadGdn", (type(impl),), {"max_head_dim": 4})
  return cls()


def _unsupported_conv():
  impl = registry.get("causal_conv1d", "reference")
  cls = type("TinyConv", (type(impl),), {"max_width": 2})
  return cls()


def test_all_implementations_failing_raise_exception_group():
  args, kw = gdn_good()
  pos = [args[n] for n in POSITIONAL["gated_delta_rule"]]
  bad1, bad2 = _unsupported_gdn(), _unsupported_gdn()
  with pytest.raises(ExceptionGroup) as info:
    gated_delta_rule(*pos, **kw, implementation=[bad1, bad2])
  assert len(info.value.exceptions) == 2
  assert all(isinstance(e, NotImplementedError) for e in info.value.exceptions)
  # Falls through to the next one on NotImplementedError.
  out, _ = gated_delta_rule(*pos, **kw, implementation=[bad1, "reference"])
  assert out.shape == (B, T, HV, DV)

  cargs, ckw = conv_good()
  with pytest.raises(ExceptionGroup):
    causal_conv1d(cargs["x"], cargs["weight"], cargs["bias"], **ckw,
                  implementation=[_unsupported_conv()])


def test_pallas_off_tpu_without_interpret_falls_through():
  assert "pallas_mosaic_tpu" in registry.implementations("gated_delta_rule")
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  if config.on_tpu():
    pytest.skip("runs on a TPU: the kernel is supported here")
  args, kw = gdn_good()
  pos = [args[n] for n in POSITIONAL["gated_delta_rule"]]
  with config.interpret_mode(False):
    with pytest.raises(ExceptionGroup):
      gated_delta_rule(*pos, **kw, implementation=["pallas_mosaic_tpu"])
    out, _ = jax.jit(lambda *p: gated_delta_rule(   # jitted: the choice is made when traced
        *p, **kw, implementation=["pallas_mosaic_tpu", "xla"]))(*pos)
  assert out.shape == (B, T, HV, DV)


# Silence "imported but unused" for the base modules kept for readers.
del conv_base, gdn_base, bf16
