"""gmm, tgmm and gmm's VJP (pallas_mosaic_tpu) compiled for real TPU generations on CPU.

A failed compile (illegal block shape for a dtype's tiling, layout, VMEM
overflow) fails the test, and so does a compiled program whose outputs are
more than the results (up to TPU layout padding) or that needs more than
`TEMP_LIMIT` of scratch beyond the cotangent a backward is given (the kernels
read their operands in place and write their results directly: temp is the
step schedule and small fusions, no operand-sized copy). Shapes:
the gmm arg specs tagged 'aot' (Qwen3.5-MoE experts), heuristics configs, bf16
on v5e / v6e / tpu7x; every mixed dtype pair, G=128 / N=512 and the
transposed-rhs layout on v6e. No cycle estimates here (`tokamax-gdn bench
--op gmm` reports those).
"""

import jax
import jax.numpy as jnp
import pytest

from tokamax_gdn import aot
from tokamax_gdn import registry
from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.tgmm.api import tgmm

pytestmark = pytest.mark.aot

IMPL = "pallas_mosaic_tpu"
BF16, F32, I8, FP8 = jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn
SPECS = registry.arg_specs("gmm", "aot")
(_LHS, _RHS, _), _ = SPECS[0].abstract()
(M, K), (G, _, N) = _LHS.shape, _RHS.shape
TEMP_LIMIT = 2 << 20


def _gmm(x, w, gs, transpose_rhs=False):
  return gmm(x, w, gs, transpose_rhs=transpose_rhs, implementation=IMPL)


def _tgmm(x, y, gs):
  return tgmm(x, y, gs, implementation=IMPL)


def _gmm_vjp(x, w, gs, transpose_rhs=False):
  """dlhs (gmm, flipped transpose) and drhs (tgmm) of <gmm(x, w), 1>, float operands only
  (compile with `_compile_vjp`)."""
  argnums = tuple(i for i, a in enumerate((x, w)) if jnp.issubdtype(a.dtype, jnp.floating))
  loss = lambda a, b: jnp.sum(_gmm(a, b, gs, transpose_rhs).astype(F32))
  return jax.grad(loss, argnums=argnums)(x, w)


def _compile(target, fn, *specs, cotangent_bytes: int = 0):
  """Compiles fn(*specs); checks the output bytes against `jax.eval_shape`'s and
  the temp bytes against `TEMP_LIMIT` (plus a backward's cotangent, which XLA
  may materialise)."""
  rep = aot.compile_for(target, fn, *specs)
  with aot.on_target(aot.target_mesh(target)):
    outs = jax.eval_shape(fn, *(jax.ShapeDtypeStruct(*s) for s in specs))
  results = sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(outs))
  assert results <= rep.output_bytes <= 1.1 * results + 4096, (results, rep)
  assert rep.temp_bytes < TEMP_LIMIT + cotangent_bytes, rep


def _compile_vjp(target, fn, x, w, gs, *, transpose_rhs=False):
  """`_compile` of a gmm backward, whose cotangent is [M, N] float32."""
  (m, _), (_, d1, d2) = x[0], w[0]
  n = d1 if transpose_rhs else d2
  return _compile(target, fn, x, w, gs, cotangent_bytes=m * n * 4)


# v5e runs these kernels on the chip (the on-chip tier's MoE shapes and
# conformance specs); its AOT compile here only repeated that.
CASES = [("v6e", s) for s in SPECS] + [("tpu7x", SPECS[0])]


@pytest.mark.parametrize("target,spec", CASES, ids=[f"{t}-{s.name}" for t, s in CASES])
def test_gmm_tgmm_and_vjp_compile_on_the_aot_specs(target, spec):
  (lhs, rhs, gs), _ = spec.abstract()
  x, w, sizes = (lhs.shape, lhs.dtype), (rhs.shape, rhs.dtype), (gs.shape, gs.dtype)
  _compile(target, _gmm, x, w, sizes)
  _compile(target, _tgmm, x, ((lhs.shape[0], rhs.shape[2]), rhs.dtype), sizes)
  _compile_vjp(target, _gmm_vjp, x, w, sizes)


@pytest.mark.parametrize("lhs_dtype,rhs_dtype", [(BF16, F32), (F32, BF16), (I8, BF16),
                                                 (FP8, BF16)],
                         ids=["bf16_x_f32", "f32_x_bf16", "int8_x_bf16", "fp8_x_bf16"])
def test_mixed_dtypes_compile_on_v6e(lhs_dtype, rhs_dtype):
  gs = ((G,), jnp.int32)
  _compile("v6e", _gmm, ((M, K), lhs_dtype), ((G, K, N), rhs_dtype), gs)
  _compile("v6e", _tgmm, ((M, K), lhs_dtype), ((M, N), rhs_dtype), gs)
  if lhs_dtype == BF16:
    _compile_vjp("v6e", _gmm_vjp, ((M, K), lhs_dtype), ((G, K, N), rhs_dtype), gs)


def test_transposed_rhs_vjp_compiles_on_v6e():
  _compile_vjp("v6e", lambda x, w, s: _gmm_vjp(x, w, s, True), ((M, K), BF16),
               ((G, N, K), BF16), ((G,), jnp.int32), transpose_rhs=True)


@pytest.mark.parametrize("lhs_dtype,rhs_dtype", [(BF16, BF16), (I8, BF16), (BF16, F32)],
                         ids=["bf16", "int8_x_bf16", "bf16_x_f32"])
def test_irregular_shapes_with_k_tail_compile_on_v6e(lhs_dtype, rhs_dtype):
  """M, K, N not multiples of 128 with tiles that leave partial M/N blocks and a masked K tail."""
  from tokamax_gdn.ops.gmm.pallas_mosaic_tpu import Config  # pylint: disable=g-import-not-at-top
  m, k, n, g = 1000, 1000, 300, 5
  cfg = Config(tm=256, tk=512, tn=256)
  gmm_op = registry.get("gmm", IMPL).replace(config=cfg)
  tgmm_op = registry.get("tgmm", IMPL).replace(config=cfg)
  gs = ((g,), jnp.int32)
  _compile("v6e", gmm_op, ((m, k), lhs_dtype), ((g, k, n), rhs_dtype), gs)
  _compile("v6e", lambda x, w, s: gmm_op(x, w, s, transpose_rhs=True),
           ((m, k), lhs_dtype), ((g, n, k), rhs_dtype), gs)
  _compile("v6e", tgmm_op, ((m, k), lhs_dtype), ((m, n), rhs_dtype), gs)
