"""Bad inputs: every op, every registered implementation, through the public API.

Wrong shapes / ranks raise ValueError and wrong dtypes TypeError, naming the
argument, before any kernel runs (each implementation's `_fwd` is replaced by a
tripwire while the call is made). NaN / inf in inputs propagate to outputs
without crashing. `implementation=` resolution errors are clear, and so is a
Pallas implementation called off a TPU. Mixed dtypes: refused where the
contract says one dtype, else computed alike by every implementation.
"""

import dataclasses
import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokamax._src.ops import op as op_lib

from tokamax_gdn import config
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
from tokamax_gdn.testing import specs

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
    # query, key and value share one dtype (out's and the kernels' matmul inputs').
    ("gated_delta_rule", "key_dtype_not_query_s", "key", TypeError,
     dict(key=z((B, T, HK, DK), bf16))),
    ("gated_delta_rule", "value_dtype_not_query_s", "value", TypeError,
     dict(value=z((B, T, HV, DV), bf16))),
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


# ------------------------------------------------- Pallas off a TPU
def _off_tpu():
  if config.on_tpu():
    pytest.skip("runs on a TPU: the kernels are supported here")
  return config.interpret_mode(False)


def _assert_names_op_and_interpret_mode(err: Exception, op_name: str) -> None:
  assert isinstance(err, config.PallasTpuUnavailableError), repr(err)
  assert isinstance(err, NotImplementedError)   # what implementation sequences fall through on
  msg = str(err)
  for part in (f"{op_name}:", "'pallas_mosaic_tpu'", jax.devices()[0].device_kind,
               "TOKAMAX_GDN_INTERPRET=1", "tokamax_gdn.config.interpret_mode()"):
    assert part in msg, f"{part!r} not in: {msg}"


@pytest.mark.parametrize("op_name", registry.list_ops())
def test_pallas_off_tpu_error_names_op_and_interpret_mode(op_name):
  """Not tokamax's bare "Not supported on cpu.": the op, the implementation
  and how to run it in interpret mode, eagerly and under jit; a sequence
  falls through it to the next implementation (the reference here: the
  cheapest to compile)."""
  args, kw = GOOD[op_name]()
  pos = [args[n] for n in POSITIONAL[op_name]]
  arrays = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
  static = {n: x for n, x in kw.items() if n not in arrays}
  with _off_tpu():
    with pytest.raises(NotImplementedError) as info:
      API[op_name](*pos, **kw, implementation="pallas_mosaic_tpu")
    _assert_names_op_and_interpret_mode(info.value, op_name)
    with pytest.raises(NotImplementedError) as info:
      _jitted(op_name, "pallas_mosaic_tpu", static)(pos, arrays)
    _assert_names_op_and_interpret_mode(info.value, op_name)
    with pytest.raises(ExceptionGroup) as group:
      API[op_name](*pos, **kw, implementation=["pallas_mosaic_tpu"])
    _assert_names_op_and_interpret_mode(group.value.exceptions[0], op_name)
    fell_through = _jitted(op_name, ("pallas_mosaic_tpu", "reference"), static)(pos, arrays)
  expected = _jitted(op_name, "reference", static)(pos, arrays)
  for got, want in zip(jax.tree.leaves(fell_through), jax.tree.leaves(expected)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# The differentiable ops whose Pallas forward is cheap to run in interpret mode.
@pytest.mark.parametrize("op_name,diff_args", [("gmm", 2), ("tgmm", 2), ("causal_conv1d", 3)])
def test_pallas_backward_off_tpu_names_op(op_name, diff_args):
  """A forward run in interpret mode whose backward is traced after it is off
  (jax.vjp's function called outside the block) gets the same error, from the
  backward's kernels."""
  args, kw = GOOD[op_name]()
  pos = [args[n] for n in POSITIONAL[op_name]]
  fn = lambda *d: API[op_name](*d, *pos[diff_args:], **kw, implementation="pallas_mosaic_tpu")
  with config.interpret_mode(True):
    out, f_vjp = jax.vjp(fn, *pos[:diff_args])
  with _off_tpu():
    with pytest.raises(NotImplementedError) as info:
      f_vjp(jax.tree.map(jnp.ones_like, out))
  # tgmm's backward is a gmm and a tgmm.
  _assert_names_op_and_interpret_mode(info.value, "gmm" if op_name == "tgmm" else op_name)


def _ops_with_a_pallas_vjp_op():
  """Ops whose Pallas implementation has a VJP Op of its own (gmm's and tgmm's
  VJP is a function of their Ops; the serving op has none)."""
  ops = [op for op in registry.list_ops()
         if isinstance(registry.get(op, "pallas_mosaic_tpu").vjp, op_lib.Op)]
  assert {"gated_delta_rule", "causal_conv1d"} <= set(ops), ops
  return ops


@pytest.mark.parametrize("op_name", _ops_with_a_pallas_vjp_op())
def test_pallas_vjp_op_off_tpu_names_op(op_name):
  """A Pallas implementation's VJP Op (the GDN and conv backward kernels)
  called off a TPU, as tokamax's backward calls it (the forward's canonical
  arguments after the residuals, outputs and cotangents, none needed before
  the device check): the error names the forward's op and the VJP's class."""
  impl = registry.get(op_name, "pallas_mosaic_tpu")
  args, kw = GOOD[op_name]()
  ba = impl.bind(*[args[n] for n in POSITIONAL[op_name]], **kw)
  fwd_kwargs = {n: x for n, x in ba.kwargs.items() if n != "return_residuals"}
  with _off_tpu():
    with pytest.raises(NotImplementedError) as info:
      impl.vjp(None, None, None, *ba.args, **fwd_kwargs)
  _assert_names_op_and_interpret_mode(info.value, op_name)
  assert type(impl.vjp).__name__ in str(info.value)


# ------------------------------------------------- implementation= of a wrong type
@pytest.mark.parametrize("op_name", registry.list_ops())
@pytest.mark.parametrize("bad,what", [(3, "3 (int)"), (["xla", 3], "element 3 (int)"),
                                      (("xla", None), "element None (NoneType)"),
                                      ({"xla"}, "(set)"), (b"xla", "element 120 (int)")],
                         ids=["int", "list_with_int", "tuple_with_none", "set", "bytes"])
def test_implementation_of_a_wrong_type_is_a_type_error(op_name, bad, what):
  """Not `'int' object is not iterable`: the argument, what it got and the
  valid names, before anything runs."""
  args, kw = GOOD[op_name]()
  pos = [args[n] for n in POSITIONAL[op_name]]
  with pytest.raises(TypeError) as info:
    API[op_name](*pos, **kw, implementation=bad)
  msg = str(info.value)
  assert msg.startswith("`implementation`") and what in msg, msg
  for name in registry.implementations(op_name):
    assert repr(name) in msg, msg


def test_layer_and_generation_implementation_of_a_wrong_type_and_an_op():
  """The layer's and generation's `implementation=` go through the same
  check; a tokamax Op per op (which they used to take apart as a sequence) is
  one implementation."""
  from tokamax_gdn.models import generation  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  model = ModelConfig.load("qwen3.5-micro")
  with pytest.raises(TypeError, match=r"`implementation` element 3 \(int\) for op 'gmm'"):
    generation.statics(model, implementation={"gmm": ["xla", 3]})
  gmm_op = registry.get("gmm", "xla")
  assert generation.statics(model, implementation={"gmm": gmm_op})["gmm_impl"] is gmm_op
  assert generation.statics(model, implementation=["xla"])["gmm_impl"] == ("xla",)
  layer = importlib.import_module("tokamax_gdn.layers.gated_deltanet")
  cfg = layer.GatedDeltaNetConfig(hidden_size=16, num_k_heads=1, num_v_heads=2,
                                  head_k_dim=8, head_v_dim=8, conv_kernel_size=4)
  params = layer.init_params(jax.random.key(0), cfg)
  x = jax.random.normal(jax.random.key(1), (1, 6, cfg.hidden_size))
  with pytest.raises(TypeError, match=r"`implementation` 3 \(int\) for op 'causal_conv1d'"):
    layer.gated_deltanet(params, x, cfg, implementation=3)
  ops = {op: registry.get(op, "reference") for op in ("causal_conv1d", "gated_delta_rule")}
  run = lambda impl: jax.jit(lambda p, x: layer.gated_deltanet(p, x, cfg, implementation=impl))
  np.testing.assert_array_equal(run(ops)(params, x), run("reference")(params, x))


# -------------------------------------------------------- mixed dtypes
def _gdn_random(dtype=f32, gate_dtype=f32, state_dtype=f32):
  """Random (never constant) small GDN inputs: positional list and keywords."""
  ks = jax.random.split(jax.random.key(7), 6)
  normal = lambda i, shape: jax.random.normal(ks[i], shape, f32)
  pos = [normal(0, (B, T, HK, DK)).astype(dtype),
         (normal(1, (B, T, HK, DK)) * DK**-0.5).astype(dtype),
         normal(2, (B, T, HV, DV)).astype(dtype),
         (-jax.nn.softplus(normal(3, (B, T, HV))) * 0.5).astype(gate_dtype),
         jax.nn.sigmoid(normal(4, (B, T, HV))).astype(gate_dtype)]
  kw = dict(initial_state=(0.1 * normal(5, (B, HV, DK, DV))).astype(state_dtype),
            output_final_state=True)
  return pos, kw


def _outputs_and_grads(fn, *diff):
  """Jitted (one compile; eager dispatch compiles every primitive): fn's
  outputs and the gradients of sum(outputs * 1) with respect to `diff`."""
  def run(*diff):
    out, f_vjp = jax.vjp(fn, *diff)
    return out, f_vjp(jax.tree.map(jnp.ones_like, out))
  return jax.jit(run)(*diff)


def test_gdn_state_of_another_float_dtype_is_cast_to_float32():
  """The documented cast (before any implementation runs): the outputs,
  final state (float32) and gradients of the float32 state holding the same
  values, the state's gradient in its own dtype."""
  pos, kw = _gdn_random(state_dtype=bf16)
  run = lambda s: gated_delta_rule(*pos, **dict(kw, initial_state=s), implementation="reference")
  (out, final), (ds,) = _outputs_and_grads(run, kw["initial_state"])
  (out32, final32), (ds32,) = _outputs_and_grads(run, kw["initial_state"].astype(f32))
  assert final.dtype == f32 and ds.dtype == bf16
  np.testing.assert_array_equal(out, out32)
  np.testing.assert_array_equal(final, final32)
  np.testing.assert_array_equal(ds, ds32.astype(bf16))


@pytest.mark.parametrize("impl_name", list(registry.implementations("gated_delta_rule")))
def test_gdn_op_refuses_a_state_that_is_not_float32(tripwire, impl_name):
  """The Ops themselves take float32 states only (the functions cast)."""
  del tripwire
  pos, kw = _gdn_random(state_dtype=bf16)
  with conf.execution_context(impl_name), pytest.raises(
      TypeError, match=r"`initial_state` .* must be float32"):
    registry.get("gated_delta_rule", impl_name)(*pos, **kw)


def test_fla_entry_point_dtypes():
  """`chunk_gated_delta_rule` casts a bf16 state as FLA's kernels read it, and
  takes q, k, v of different dtypes as FLA does: run in their common dtype,
  `o` in q's."""
  from tokamax_gdn.ops.gated_delta_rule.fla import chunk_gated_delta_rule  # pylint: disable=g-import-not-at-top
  pos, kw = _gdn_random(state_dtype=bf16)
  q, *rest = pos
  run = jax.jit(lambda q, s: chunk_gated_delta_rule(q, *rest, **dict(kw, initial_state=s),
                                                    implementation="reference"))
  out, final = run(q.astype(bf16), kw["initial_state"])
  want_out, want_final = run(q.astype(bf16).astype(f32), kw["initial_state"].astype(f32))
  assert out.dtype == bf16 and final.dtype == f32
  np.testing.assert_array_equal(out, want_out.astype(bf16))
  np.testing.assert_array_equal(final, want_final)


def _assert_as_the_reference(got, want, tol: float) -> None:
  """Same dtypes leaf by leaf, values within `tol` (rel-RMS)."""
  for i, (a, e) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
    assert a.dtype == e.dtype, (i, a.dtype, e.dtype)
    assert specs.rel_rms(a, e) < tol, (i, specs.rel_rms(a, e))


# The Pallas kernels in interpret mode take ~40 s for this on a CPU: on the chip only.
@pytest.mark.parametrize("impl_name", ["xla", pytest.param("pallas_mosaic_tpu",
                                                           marks=pytest.mark.tpu)])
def test_gdn_gates_of_another_dtype_as_the_reference(impl_name):
  """bf16 q, k, v with float32 g and beta (as HF computes the gate): the
  implementation computes what the reference does, `out` in value's dtype
  and each gradient in its input's dtype."""
  pos, kw = _gdn_random(bf16, f32)
  results = {}
  for name in ("reference", impl_name):
    with conf.execution_context(name):
      results[name] = _outputs_and_grads(
          lambda *p, name=name: gated_delta_rule(*p, **kw, implementation=name), *pos)
  (out, _), grads = results["reference"]
  assert out.dtype == bf16 and [g.dtype for g in grads] == [bf16] * 3 + [f32] * 2
  _assert_as_the_reference(results[impl_name], results["reference"], 2e-2)


@pytest.mark.parametrize("impl_name", list(registry.implementations("causal_conv1d")))
def test_conv_mixed_dtypes_as_the_reference(impl_name):
  """bf16 x with float32 weight, bias and state: `y` and the final state in
  x's dtype, each gradient in its input's dtype, the reference's values."""
  ks = jax.random.split(jax.random.key(3), 4)
  x = jax.random.normal(ks[0], (B, T, D), f32).astype(bf16)
  weight, bias = jax.random.normal(ks[1], (D, W)), jax.random.normal(ks[2], (D,))
  state = jax.random.normal(ks[3], (B, W - 1, D))
  results = {}
  for name in ("reference", impl_name):
    with conf.execution_context(name):
      results[name] = _outputs_and_grads(
          lambda *a, name=name: causal_conv1d(*a[:3], initial_state=a[3], output_final_state=True,
                                              implementation=name), x, weight, bias, state)
  (y, final), grads = results["reference"]
  assert y.dtype == final.dtype == bf16 and [g.dtype for g in grads] == [bf16] + [f32] * 3
  _assert_as_the_reference(results[impl_name], results["reference"], 2e-2)


@pytest.mark.parametrize("impl_name", list(registry.implementations(
    "causal_conv1d_gated_delta_rule")))
def test_serving_mixed_dtypes_as_the_reference(impl_name):
  """The serving op's float inputs each in its own dtype (bf16 qkv, a float32
  conv pool, a bf16 recurrent pool, float32 parameters): the pools keep their
  dtypes, `out` is qkv's, the values the reference's."""
  op_name = "causal_conv1d_gated_delta_rule"
  args, kw = serve_good()
  ks = iter(jax.random.split(jax.random.key(5), 9))
  dtypes = dict(qkv=bf16, recurrent_state=bf16, b=bf16)
  for n in ("qkv", "b", "a", "conv_state", "recurrent_state", "conv_weight", "conv_bias",
            "a_log", "dt_bias"):
    args[n] = (0.3 * jax.random.normal(next(ks), args[n].shape)).astype(dtypes.get(n, f32))
  args["seq_lens"] = jnp.array([T + 4], i32)   # continues slot 1's states
  pos = [args[n] for n in POSITIONAL[op_name]]
  results = {}
  for name in ("reference", impl_name):
    with conf.execution_context(name):
      results[name] = _jitted(op_name, name, kw)(pos, {})
  (conv_pool, rec_pool), out = results["reference"]
  assert (conv_pool.dtype, rec_pool.dtype, out.dtype) == (f32, bf16, bf16)
  _assert_as_the_reference(results[impl_name], results["reference"], 2e-2)


# Silence "imported but unused" for the base modules kept for readers.
del conv_base, gdn_base
