"""Shared gmm test cases and checks against `jax.lax.ragged_dot` (float32, HIGHEST).

Each check runs jitted: one compile per case instead of op-by-op dispatch
(several times cheaper at these shapes)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.gmm import pallas_mosaic_tpu as pallas
from tokamax_gdn.ops.gmm.base import canonical_out_dtype
from tokamax_gdn.testing.specs import rel_rms, tolerance

F32, BF16, I8, FP8 = jnp.float32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class Case:
  name: str
  m: int
  k: int
  n: int
  group_sizes: tuple[int, ...]
  lhs_dtype: object = F32
  rhs_dtype: object = None
  transpose_rhs: bool = False

  def __str__(self):
    return self.name


CASES = [
    Case("f32_zeros_sum_lt_m", 64, 48, 40, (10, 0, 25, 15)),
    Case("bf16", 96, 128, 136, (0, 40, 0, 30, 26), BF16),
    Case("f32_one_group", 40, 24, 24, (0, 40, 0)),
    Case("f32_all_empty", 24, 16, 16, (0, 0)),
    Case("f32_transposed", 50, 40, 24, (20, 0, 25), transpose_rhs=True),
    Case("bf16_x_f32", 48, 64, 32, (5, 20, 0, 23), BF16, F32),
    Case("f32_x_bf16", 48, 64, 32, (17, 0, 21, 3), F32, BF16),
    Case("int8_x_bf16", 64, 32, 48, (30, 10, 20), I8, BF16),
    Case("fp8_x_bf16", 64, 32, 48, (12, 0, 40), FP8, BF16),
    Case("bf16_G1_sum_lt_m", 40, 24, 24, (33,), BF16),
]
SMALL = {c.name: c for c in CASES}


def inputs(case: Case, seed: int = 0, nan_tail: bool = True):
  """Random lhs/rhs; with `nan_tail`, lhs rows past sum(group_sizes) hold NaN
  (a floating lhs): gmm gives zeros there and its backward ignores them."""
  rng = np.random.default_rng(seed)
  rhs_dtype = case.rhs_dtype or case.lhs_dtype
  lhs = rng.standard_normal((case.m, case.k)).astype(np.float32)
  if jnp.issubdtype(case.lhs_dtype, jnp.integer):
    lhs = np.clip(np.round(lhs * 40), -127, 127)
  elif nan_tail:
    lhs[sum(case.group_sizes):] = np.nan
  g = len(case.group_sizes)
  shape = (g, case.n, case.k) if case.transpose_rhs else (g, case.k, case.n)
  rhs = rng.standard_normal(shape).astype(np.float32) * case.k**-0.5
  gs = jnp.asarray(case.group_sizes, jnp.int32)
  return jnp.asarray(lhs).astype(case.lhs_dtype), jnp.asarray(rhs).astype(rhs_dtype), gs


def expected(lhs, rhs, gs, transpose_rhs):
  """`jax.lax.ragged_dot` in float32 at HIGHEST precision, on the rows inside
  the groups (the others zeroed: ragged_dot's own contract for them)."""
  rhs32 = rhs.astype(F32)
  if transpose_rhs:
    rhs32 = jnp.swapaxes(rhs32, 1, 2)
  keep = (jnp.arange(lhs.shape[0]) < jnp.sum(gs))[:, None]
  return jax.lax.ragged_dot(jnp.where(keep, lhs.astype(F32), 0.0), rhs32, gs,
                            precision=jax.lax.Precision.HIGHEST)


def _tol(case: Case, grad: bool) -> float:
  dts = [d for d in (case.lhs_dtype, case.rhs_dtype or case.lhs_dtype)]
  if all(jnp.dtype(d) == jnp.float32 for d in dts):
    return tolerance(F32, grad=grad)
  return tolerance(BF16, grad=grad)


def check_forward(implementation, case: Case, **kwargs):
  lhs, rhs, gs = inputs(case)
  out = jax.jit(lambda a, b, s: gmm(a, b, s, transpose_rhs=case.transpose_rhs,
                                    implementation=implementation, **kwargs))(lhs, rhs, gs)
  assert out.shape == (case.m, case.n)
  assert out.dtype == canonical_out_dtype(lhs, rhs, None)
  want = jax.jit(expected, static_argnums=3)(lhs, rhs, gs, case.transpose_rhs)
  total = sum(case.group_sizes)
  assert np.all(np.asarray(out[total:], np.float32) == 0), "rows past sum(group_sizes) not zero"
  if total:
    err = rel_rms(out[:total], want[:total])
    assert err <= _tol(case, grad=False), f"{case}: rel-RMS {err:.3g}"


def check_vjp(implementation, case: Case):
  """Gradients of <gmm(lhs, rhs), ct> against autodiff of float32 ragged_dot."""
  lhs, rhs, gs = inputs(case)
  ct = jax.random.normal(jax.random.key(3), (case.m, case.n), F32)
  float_args = [i for i, x in enumerate((lhs, rhs)) if jnp.issubdtype(x.dtype, jnp.floating)]

  def loss(fn, a, b):
    return jnp.sum(fn(a, b).astype(F32) * ct)

  ours = lambda a, b: gmm(a, b, gs, transpose_rhs=case.transpose_rhs,
                          implementation=implementation)
  theirs = lambda a, b: expected(a, b, gs, case.transpose_rhs)
  got = jax.jit(jax.grad(functools_partial(loss, ours), argnums=tuple(float_args)))(lhs, rhs)
  want = jax.jit(jax.grad(functools_partial(loss, theirs), argnums=tuple(float_args)))(
      lhs.astype(F32) if 0 in float_args else lhs, rhs.astype(F32))
  total = sum(case.group_sizes)
  for i, g, w in zip(float_args, got, want):
    assert g.dtype == (lhs, rhs)[i].dtype
    if i == 0:
      assert np.all(np.asarray(g[total:], np.float32) == 0), "dlhs past sum(group_sizes) not zero"
    if g.dtype.itemsize == 1:  # an fp8 gradient: compare at fp8 resolution.
      w = w.astype(g.dtype)
    err = rel_rms(g, w)
    assert err <= _tol(case, grad=True), f"{case}: d{'lhs' if i == 0 else 'rhs'} rel-RMS {err:.3g}"


def check_heuristic_in_fitting_space(op, ba, vmem) -> None:
  """A Pallas gmm/tgmm call's heuristic config is among its autotuning configs,
  and every one of those has a VMEM estimate `vmem(config)` within the budget."""
  space = op._get_autotuning_configs(ba)  # pylint: disable=protected-access
  assert ba.heuristics_config in space
  budget = pallas.vmem_budget()
  assert all(vmem(c) <= budget for c in space)


def functools_partial(fn, first):
  return lambda *a: fn(first, *a)
