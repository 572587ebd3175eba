"""Validation run: every implementation vs `reference` at a model preset's shapes.

Used by `tokamax-gdn validate`. Inputs are fresh random arrays shaped like one
GatedDeltaNet layer of the preset (heads, head dims, conv width); gmm/tgmm use
an MoE-like [tokens, hidden] x [8 experts, hidden, hidden // 4] problem.
"""

import time

import jax
import jax.numpy as jnp

from tokamax_gdn import autotuning
from tokamax_gdn import config
from tokamax_gdn import progress as progress_lib
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs
from tokamax_gdn.testing import conformance
from tokamax_gdn.testing import specs as specs_lib


def _gdn_case(cfg, batch, seq_len, key):
  args, kwargs = random_inputs(key, b=batch, t=seq_len, hk=cfg.num_k_heads,
                               hv=cfg.num_v_heads, dk=cfg.head_k_dim,
                               dv=cfg.head_v_dim, gate=True, segments=2)
  kwargs["use_qk_l2norm"] = True
  shape = (f"B{batch} T{seq_len} Hk{cfg.num_k_heads} Hv{cfg.num_v_heads}"
           f" K{cfg.head_k_dim} V{cfg.head_v_dim}")
  diff = ("query", "key", "value", "g", "beta", "initial_state", "a_log", "dt_bias")
  return args, kwargs, diff, shape


def _conv_case(cfg, batch, seq_len, key):
  d, w = cfg.conv_dim, cfg.conv_kernel_size
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (batch, seq_len, d), jnp.float32)
  weight = jax.random.normal(k2, (d, w), jnp.float32) * w**-0.5
  h0 = jax.random.normal(k3, (batch, w - 1, d), jnp.float32)
  kwargs = dict(initial_state=h0, output_final_state=True)
  return (x, weight), kwargs, ("x", "weight", "initial_state"), f"B{batch} T{seq_len} D{d} W{w}"


def _group_sizes(key, m, groups):
  cuts = jnp.sort(jax.random.randint(key, (groups - 1,), 0, m + 1))
  edges = jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts, jnp.full((1,), m, cuts.dtype)])
  return jnp.diff(edges).astype(jnp.int32)


def _gmm_case(cfg, batch, seq_len, key):
  m, k, n, g = batch * seq_len, cfg.hidden_size, max(cfg.hidden_size // 4, 8), 8
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32)
  rhs = jax.random.normal(k2, (g, k, n), jnp.float32) * k**-0.5
  return (lhs, rhs, _group_sizes(k3, m, g)), {}, ("lhs", "rhs"), f"M{m} K{k} N{n} G{g}"


def _tgmm_case(cfg, batch, seq_len, key):
  m, k, n, g = batch * seq_len, cfg.hidden_size, max(cfg.hidden_size // 4, 8), 8
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32)
  rhs = jax.random.normal(k2, (m, n), jnp.float32)
  return (lhs, rhs, _group_sizes(k3, m, g)), {}, ("lhs", "rhs"), f"M{m} K{k} N{n} G{g}"


CASES = {
    "gated_delta_rule": _gdn_case,
    "causal_conv1d": _conv_case,
    "gmm": _gmm_case,
    "tgmm": _tgmm_case,
}


def _runnable(impl_name: str, interpret: bool) -> str | None:
  """None if runnable here, else why not."""
  if impl_name == "pallas_mosaic_tpu" and not config.on_tpu() and not interpret:
    return "skipped: no TPU (add --interpret)"
  return None


def _prepare(op_name, case, key):
  """What every implementation of `op_name` is checked against, computed once:
  the case's differentiable arguments, the call, and the reference's output
  and gradients (jitted)."""
  args, kwargs, diff_names, shape = case
  spec = autotuning.ArgSpec(name=op_name, make=lambda _: (args, kwargs),
                           diff_argnames=diff_names)
  ref = registry.get(op_name, "reference")
  diff, call = conformance.split_diff(spec, ref, args, kwargs)
  dtype = conformance.lowest_float_dtype(args, kwargs)
  return diff, call, dtype, shape, conformance.loss_and_grads(ref, call, diff, key)


def _check(op_name, impl_name, prepared, key):
  diff, call, dtype, shape, (expected, expected_grads) = prepared
  impl = registry.get(op_name, impl_name)
  with conformance.execution_context(impl_name):
    run = jax.jit(lambda d: conformance.loss_and_grads(impl, call, d, key))
    out, grads = jax.block_until_ready(run(diff))
    start = time.perf_counter()
    jax.block_until_ready(run(diff))
    ms = (time.perf_counter() - start) * 1e3
  leaves = lambda t: [x for x in jax.tree.leaves(t) if x is not None]
  fwd_err = max(specs_lib.rel_rms(a, e) for a, e in zip(leaves(out), leaves(expected)))
  grad_err = max(specs_lib.rel_rms(grads[n], expected_grads[n]) for n in diff)
  finite = all(bool(jnp.all(jnp.isfinite(x))) for x in leaves((out, grads)))
  ok = (finite and fwd_err <= specs_lib.tolerance(dtype, grad=False)
        and grad_err <= specs_lib.tolerance(dtype, grad=True))
  return dict(op=op_name, implementation=impl_name, shape=shape,
              fwd_rel_rms=f"{fwd_err:.2e}", grad_rel_rms=f"{grad_err:.2e}",
              fwd_bwd_ms=f"{ms:.1f}", status="PASS" if ok else "FAIL")


def _prepare_layer(cfg, batch, seq_len, key):
  """The layer's parameters, input and reference output (jitted), once."""
  from tokamax_gdn import layers as layer  # pylint: disable=g-import-not-at-top
  kp, kx = jax.random.split(key)
  params = layer.init_params(kp, cfg)
  x = jax.random.normal(kx, (batch, seq_len, cfg.hidden_size), jnp.float32)
  expected = jax.jit(lambda p, x: layer.gated_deltanet(p, x, cfg, implementation="reference"))(
      params, x)
  return params, x, expected


def _check_layer(cfg, impl_name, prepared):
  from tokamax_gdn import layers as layer  # pylint: disable=g-import-not-at-top
  params, x, expected = prepared
  with conformance.execution_context(impl_name):
    fn = jax.jit(lambda p, x: layer.gated_deltanet(p, x, cfg, implementation=impl_name))
    y = jax.block_until_ready(fn(params, x))
    start = time.perf_counter()
    jax.block_until_ready(fn(params, x))
    ms = (time.perf_counter() - start) * 1e3
  err = specs_lib.rel_rms(y, expected)
  ok = bool(jnp.all(jnp.isfinite(y))) and err <= specs_lib.tolerance(jnp.float32, grad=False)
  batch, seq_len = x.shape[:2]
  return dict(op="layer:gated_deltanet", implementation=impl_name,
              shape=f"B{batch} T{seq_len} hidden{cfg.hidden_size}",
              fwd_rel_rms=f"{err:.2e}", grad_rel_rms="-", fwd_bwd_ms=f"{ms:.1f} (fwd)",
              status="PASS" if ok else "FAIL")


def run(cfg, *, seq_len: int = 64, batch: int = 1, interpret: bool = False,
        progress: bool = True) -> list[dict]:
  """Runs every check; returns one row per (op, implementation) and layer."""
  jobs = []
  for op_name, make_case in CASES.items():
    for impl_name in registry.implementations(op_name):
      jobs.append((op_name, impl_name, make_case))
  layer_impls = [n for n in registry.implementations("gated_delta_rule")
                 if n in registry.implementations("causal_conv1d")]
  jobs += [("layer", n, None) for n in layer_impls]
  rows = []
  key = jax.random.key(0)
  prepared = {}   # per op: its case and reference results, shared by its implementations
  for op_name, impl_name, make_case in progress_lib.bar(jobs, disable=not progress, desc="validate"):
    why = _runnable(impl_name, interpret)
    if why is not None:
      rows.append(dict(op=op_name if op_name != "layer" else "layer:gated_deltanet",
                       implementation=impl_name, shape="-", fwd_rel_rms="-",
                       grad_rel_rms="-", fwd_bwd_ms="-", status=why))
      continue
    try:
      if op_name not in prepared:
        prepared[op_name] = (_prepare_layer(cfg, batch, seq_len, key) if op_name == "layer"
                             else _prepare(op_name, make_case(cfg, batch, seq_len, key), key))
      if op_name == "layer":
        rows.append(_check_layer(cfg, impl_name, prepared[op_name]))
      else:
        rows.append(_check(op_name, impl_name, prepared[op_name], key))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(dict(op=op_name, implementation=impl_name, shape="-", fwd_rel_rms="-",
                       grad_rel_rms="-", fwd_bwd_ms="-",
                       status=f"FAIL ({type(e).__name__}: {str(e)[:160]})"))
  return rows
