"""The Pallas Mosaic TPU kernels of the gated RMSNorm: a grid over blocks of
rows of x [B, N, D], each block's rows whole in VMEM, and in the block a loop
over the D / V groups of each row (lane-aligned column slices: V is a
multiple of 128, or all of D). A group's mean over V is then a reduction
across the lanes, and its broadcast back over V free; on x's own
[rows, D] layout nothing is relaid out in HBM (XLA, for the same math,
materialised the broadcast statistics and relaid out [..., D] as [..., D/V, V]).

Both kernels evaluate `base.forward` / `base.backward` on each group (the
math is written once). The backward writes each block's part of dweight
([1, V], its groups and rows summed, rows past the array's end masked out);
the wrapper sums the parts.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from tokamax_gdn.ops.gated_rmsnorm import base

F32 = jnp.float32
# Groups unrolled per loop step. libtpu's estimate of the forward at
# qwen3.5-tiny's norm ([4096, 32·128] bf16, 128-row blocks) went from 1.6x
# the HBM floor rolled to the floor with 8.
UNROLL = 8


def _columns(h, v: int):
  """Group h's columns of a row block (a multiple of 128 lanes, or all)."""
  return pl.ds(pl.multiple_of(h * v, v), v)


def _fwd_kernel(x_ref, g_ref, w_ref, y_ref, *, eps, v):
  w = w_ref[...]

  def group(h, carry):
    cols = _columns(h, v)
    y_ref[:, cols] = base.forward(x_ref[:, cols], g_ref[:, cols], w, eps)[0].astype(y_ref.dtype)
    return carry

  jax.lax.fori_loop(0, x_ref.shape[-1] // v, group, 0, unroll=UNROLL)


def _bwd_kernel(x_ref, g_ref, w_ref, dy_ref, dx_ref, dg_ref, dw_ref, *, eps, v, n_rows):
  w = w_ref[...]
  block = x_ref.shape[0]

  def group(h, dw):
    cols = _columns(h, v)
    dx, dg, dw_terms = base.backward(x_ref[:, cols], g_ref[:, cols], w, dy_ref[:, cols], eps)
    dx_ref[:, cols] = dx.astype(dx_ref.dtype)
    dg_ref[:, cols] = dg.astype(dg_ref.dtype)
    return dw + dw_terms

  dw = jax.lax.fori_loop(0, x_ref.shape[-1] // v, group, jnp.zeros((block, v), F32),
                         unroll=UNROLL)
  row = pl.program_id(1) * block + jax.lax.broadcasted_iota(jnp.int32, dw.shape, 0)
  dw_ref[...] = jnp.sum(jnp.where(row < n_rows, dw, 0.0), axis=0, keepdims=True)


def _specs(block_rows: int, d: int, v: int):
  rows = pl.BlockSpec((None, block_rows, d), lambda b, i: (b, i, 0))
  weight = pl.BlockSpec((1, v), lambda b, i: (0, 0))
  return rows, weight


def _params(vmem_limit_bytes: int):
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                              vmem_limit_bytes=vmem_limit_bytes)


def gated_rmsnorm_fwd(x, gate, weight, *, eps: float, block_rows: int, interpret: bool,
                      vmem_limit_bytes: int):
  """y [B, N, D] in x's dtype, for x, gate [B, N, D] and weight [V]
  (V a multiple of 128 dividing D, or D)."""
  b, n, d = x.shape
  v = weight.shape[0]
  rows, w_spec = _specs(block_rows, d, v)
  return pl.pallas_call(
      functools.partial(_fwd_kernel, eps=eps, v=v),
      grid=(b, pl.cdiv(n, block_rows)),
      in_specs=[rows, rows, w_spec],
      out_specs=rows,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=_params(vmem_limit_bytes),
      interpret=interpret,
      name="gated_rmsnorm_fwd",
  )(x, gate, weight.reshape(1, v))


def gated_rmsnorm_bwd(x, gate, weight, dy, *, eps: float, block_rows: int, interpret: bool,
                      vmem_limit_bytes: int):
  """(dx, dgate [B, N, D] in x's / gate's dtypes, dweight parts [B, V]
  float32: each batch row's rows and groups summed)."""
  b, n, d = x.shape
  v = weight.shape[0]
  blocks = pl.cdiv(n, block_rows)
  rows, w_spec = _specs(block_rows, d, v)
  dx, dg, dw = pl.pallas_call(
      functools.partial(_bwd_kernel, eps=eps, v=v, n_rows=n),
      grid=(b, blocks),
      in_specs=[rows, rows, w_spec, rows],
      out_specs=[rows, rows, pl.BlockSpec((None, None, 1, v), lambda b, i: (b, i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct(gate.shape, gate.dtype),
                 jax.ShapeDtypeStruct((b, blocks, 1, v), F32)],
      compiler_params=_params(vmem_limit_bytes),
      interpret=interpret,
      name="gated_rmsnorm_bwd",
  )(x, gate, weight.reshape(1, v), dy)
  return dx, dg, jnp.sum(dw, axis=(1, 2))
