"""Shared tgmm test cases and checks against `jax.lax.ragged_dot_general` (float32).

Each check runs jitted: one compile per case instead of op-by-op dispatch."""

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.ops.gmm.base import canonical_out_dtype
from tokamax_gdn.ops.tgmm.api import tgmm
from tokamax_gdn.ops.tgmm.base import DIMS
from tokamax_gdn.testing.specs import rel_rms, tolerance

from ..gmm import cases as gmm_cases
from ..gmm.cases import BF16, F32, FP8, I8, Case  # pylint: disable=unused-import


# The gmm cases without a transposed rhs (tgmm has no such layout).
CASES = [c for c in gmm_cases.CASES if not c.transpose_rhs]
SMALL = {c.name: c for c in CASES}


def inputs(case: Case, seed: int = 0, garbage_tail: bool = True):
  """Random lhs/rhs; rows past sum(group_sizes) hold inf/NaN (tgmm must ignore them)."""
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((case.m, case.k)).astype(np.float32)
  if jnp.issubdtype(case.lhs_dtype, jnp.integer):
    lhs = np.clip(np.round(lhs * 40), -127, 127)
  rhs = rng.standard_normal((case.m, case.n)).astype(np.float32)
  total = sum(case.group_sizes)
  if garbage_tail and total < case.m:
    if jnp.issubdtype(case.lhs_dtype, jnp.floating):
      lhs[total:] = np.inf
    rhs[total:] = np.nan
  gs = jnp.asarray(case.group_sizes, jnp.int32)
  return (jnp.asarray(lhs).astype(case.lhs_dtype),
          jnp.asarray(rhs).astype(case.rhs_dtype or case.lhs_dtype), gs)


def expected(lhs, rhs, gs, total: int):
  """`jax.lax.ragged_dot_general` (ragged contraction) in float32 on the
  finite rows (the first `total`)."""
  keep = (jnp.arange(lhs.shape[0]) < total)[:, None]
  lhs32 = jnp.where(keep, lhs.astype(F32), 0.0)
  rhs32 = jnp.where(keep, rhs.astype(F32), 0.0)
  return jax.lax.ragged_dot_general(lhs32, rhs32, gs, DIMS, precision=jax.lax.Precision.HIGHEST)


def _tol(case: Case, grad: bool) -> float:
  if all(jnp.dtype(d) == F32 for d in (case.lhs_dtype, case.rhs_dtype or case.lhs_dtype)):
    return tolerance(F32, grad=grad)
  return tolerance(BF16, grad=grad)


def check_forward(implementation, case: Case, garbage_tail: bool = True):
  lhs, rhs, gs = inputs(case, garbage_tail=garbage_tail)
  out = jax.jit(lambda a, b, s: tgmm(a, b, s, implementation=implementation))(lhs, rhs, gs)
  g = len(case.group_sizes)
  assert out.shape == (g, case.k, case.n)
  assert out.dtype == canonical_out_dtype(lhs, rhs, None)
  assert np.all(np.isfinite(np.asarray(out, np.float32)))
  want = jax.jit(expected, static_argnums=3)(lhs, rhs, gs, sum(case.group_sizes))
  for i, size in enumerate(case.group_sizes):
    if size == 0:
      assert np.all(np.asarray(out[i], np.float32) == 0), f"empty group {i} not zero"
  if sum(case.group_sizes):
    err = rel_rms(out, want)
    assert err <= _tol(case, grad=False), f"{case}: rel-RMS {err:.3g}"


def check_vjp(implementation, case: Case):
  """Gradients against autodiff of the dense masked form, with inf / NaN rows
  past sum(group_sizes) (their gradients must be zero, the others finite)."""
  lhs, rhs, gs = inputs(case)
  g = len(case.group_sizes)
  ct = jax.random.normal(jax.random.key(3), (g, case.k, case.n), F32)
  float_args = tuple(i for i, x in enumerate((lhs, rhs)) if jnp.issubdtype(x.dtype, jnp.floating))
  ours = lambda a, b: jnp.sum(tgmm(a, b, gs, implementation=implementation).astype(F32) * ct)
  # JAX has no autodiff for a ragged contraction: differentiate the dense
  # masked form sum_m mask[g, m] a[m, k] b[m, n] instead.
  ends = jnp.cumsum(gs)
  rows = jnp.arange(case.m)
  masks = ((rows[None] >= (ends - gs)[:, None]) & (rows[None] < ends[:, None])).astype(F32)
  theirs = lambda a, b: jnp.sum(
      jnp.einsum("gm,mk,mn->gkn", masks, a, b, precision=jax.lax.Precision.HIGHEST) * ct)
  got = jax.jit(jax.grad(ours, argnums=float_args))(lhs, rhs)
  total = sum(case.group_sizes)
  keep = (jnp.arange(case.m) < total)[:, None]
  clean = [jnp.where(keep, x.astype(F32), 0.0) for x in (lhs, rhs)]
  want = jax.jit(jax.grad(theirs, argnums=float_args))(*clean)
  for i, gr, w in zip(float_args, got, want):
    assert gr.dtype == (lhs, rhs)[i].dtype
    assert np.all(np.asarray(gr[total:], np.float32) == 0), "grad past sum(group_sizes) not zero"
    if gr.dtype.itemsize == 1:
      w = w.astype(gr.dtype)
    err = rel_rms(gr, w)
    assert err <= _tol(case, grad=True), f"{case}: d{'lhs' if i == 0 else 'rhs'} rel-RMS {err:.3g}"
