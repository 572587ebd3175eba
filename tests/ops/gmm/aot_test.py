"""gmm, tgmm and gmm's VJP (pallas_mosaic_tpu) compiled for real TPU generations on CPU.

A failed compile (illegal block shape for a dtype's tiling, layout, VMEM
overflow) fails the test. Qwen3.5-MoE expert shapes, heuristics configs:
bf16 on v5e / v6e / tpu7x; every mixed dtype pair, G=128 / N=512 and the
transposed-rhs layout on v6e. No cycle estimates here (`tokamax-gdn bench
--op gmm` reports those).
"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import jax
import jax.numpy as jnp
import pytest

from tokamax_gdn import aot
from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.tgmm.api import tgmm

pytestmark = pytest.mark.aot

IMPL = "pallas_mosaic_tpu"
BF16, F32, I8, FP8 = jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn
M, K, N, G = 8192, 2048, 1024, 8


def _gmm(x, w, gs, transpose_rhs=False):
  return gmm(x, w, gs, transpose_rhs=transpose_rhs, implementation=IMPL)


def _tgmm(x, y, gs):
  return tgmm(x, y, gs, implementation=IMPL)


def _gmm_vjp(x, w, gs, transpose_rhs=False):
  """dlhs (gmm, flipped transpose) and drhs (tgmm) of <gmm(x, w), 1>, float operands only."""
  argnums = tuple(i for i, a in enumerate((x, w)) if jnp.issubdtype(a.dtype, jnp.floating))
  loss = lambda a, b: jnp.sum(_gmm(a, b, gs, transpose_rhs).astype(F32))
  return jax.grad(loss, argnums=argnums)(x, w)


def _compile(target, fn, *specs):
  rep = aot.compile_for(target, fn, *specs)
  assert rep.temp_bytes >= 0


@pytest.mark.parametrize("target", ["v5e", "v6e", "tpu7x"])
def test_bf16_gmm_tgmm_and_vjp_compile(target):
  x, w, gs = ((M, K), BF16), ((G, K, N), BF16), ((G,), jnp.int32)
  _compile(target, _gmm, x, w, gs)
  _compile(target, _tgmm, x, ((M, N), BF16), gs)
  _compile(target, _gmm_vjp, x, w, gs)


@pytest.mark.parametrize("lhs_dtype,rhs_dtype", [(BF16, F32), (F32, BF16), (I8, BF16),
                                                 (FP8, BF16)],
                         ids=["bf16_x_f32", "f32_x_bf16", "int8_x_bf16", "fp8_x_bf16"])
def test_mixed_dtypes_compile_on_v6e(lhs_dtype, rhs_dtype):
  gs = ((G,), jnp.int32)
  _compile("v6e", _gmm, ((M, K), lhs_dtype), ((G, K, N), rhs_dtype), gs)
  _compile("v6e", _tgmm, ((M, K), lhs_dtype), ((M, N), rhs_dtype), gs)
  if lhs_dtype == BF16:
    _compile("v6e", _gmm_vjp, ((M, K), lhs_dtype), ((G, K, N), rhs_dtype), gs)


def test_many_groups_and_transposed_rhs_compile_on_v6e():
  g, n = 128, 512
  gs = ((g,), jnp.int32)
  _compile("v6e", _gmm_vjp, ((M, K), BF16), ((g, K, n), BF16), gs)
  _compile("v6e", _tgmm, ((M, K), BF16), ((M, n), BF16), gs)
  _compile("v6e", lambda x, w, s: _gmm_vjp(x, w, s, True), ((M, K), BF16), ((G, N, K), BF16),
           ((G,), jnp.int32))


@pytest.mark.parametrize("lhs_dtype,rhs_dtype", [(BF16, BF16), (I8, BF16), (BF16, F32)],
                         ids=["bf16", "int8_x_bf16", "bf16_x_f32"])
def test_irregular_shapes_with_k_tail_compile_on_v6e(lhs_dtype, rhs_dtype):
  """M, K, N not multiples of 128 with tiles that leave partial M/N blocks and a masked K tail."""
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
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
