"""pallas_mosaic_tpu gated RMSNorm against the reference in Pallas interpret
mode (tiny shapes), at the edges the conformance specs do not pin: a partial
last row block (its rows must not reach dweight), groups of V < 128 (the
[rows·D/V, V] view), several batch rows, configs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config
from tokamax_gdn import gated_rmsnorm
from tokamax_gdn.ops.gated_rmsnorm import arg_specs
from tokamax_gdn.ops.gated_rmsnorm import pallas_mosaic_tpu as pk
from tokamax_gdn.testing import specs


def _op(block_rows):
  op = pk.PallasMosaicTpuGatedRmsNorm(config=pk.Config(block_rows=block_rows))
  return op.replace(vjp=op.vjp.replace(config=pk.Config(block_rows=block_rows)))


def _fwd_bwd(impl, args, kw, cot):
  f = lambda x, g, w: gated_rmsnorm(x, g, w, implementation=impl, **kw)
  y, vjp = jax.vjp(f, *args)
  return y, vjp(cot)


@pytest.mark.parametrize("shape,v,dtype,block_rows", [
    ((2, 37, 256), 128, jnp.float32, 16),    # 3 blocks per batch row, the last partial
    ((1, 21, 128), 32, jnp.float32, 16),     # V < 128: [84, 32] rows, last block partial
    ((3, 5, 256), 256, jnp.bfloat16, 16),    # fewer rows than a block: one block of 5
], ids=["partial_block", "small_heads", "bf16_one_block"])
def test_matches_reference(shape, v, dtype, block_rows):
  args, kw = arg_specs.random_inputs(jax.random.key(0), shape=shape, v=v, dtype=dtype)
  cot = jax.random.normal(jax.random.key(1), shape).astype(dtype)
  with config.interpret_mode(True):
    y, grads = jax.jit(lambda a, c: _fwd_bwd(_op(block_rows), a, kw, c))(args, cot)
  f32 = tuple(a.astype(jnp.float32) for a in args)
  ry, rgrads = jax.jit(lambda a, c: _fwd_bwd("reference", a, kw, c))(f32, cot.astype(jnp.float32))
  assert y.dtype == dtype
  assert specs.rel_rms(y, ry) < specs.tolerance(dtype, grad=False)
  for g, r, name in zip(grads, rgrads, ("x", "gate", "weight")):
    assert g.dtype == dtype, name
    assert specs.rel_rms(g, r) < specs.tolerance(dtype, grad=True), name


def test_rows_past_the_end_do_not_reach_dweight():
  """A partial last block reads past the array: those rows are masked out of
  dweight (a NaN there would poison it, a stale row would bias it)."""
  args, kw = arg_specs.random_inputs(jax.random.key(2), shape=(1, 20, 128))
  cot = jnp.ones((1, 20, 128))
  with config.interpret_mode(True):
    _, (_, _, dw) = jax.jit(lambda a: _fwd_bwd(_op(16), a, kw, cot))(args)
    _, (_, _, dw_whole) = jax.jit(lambda a: _fwd_bwd(_op(32), a, kw, cot))(args)
  assert np.isfinite(np.asarray(dw)).all()
  np.testing.assert_allclose(dw, dw_whole, rtol=1e-5, atol=1e-5)


def test_heuristics_in_the_autotuning_space():
  for shape, v in (((1, 4096, 4096), 128), ((128, 16, 128), 32), ((7, 128), 128)):
    args, kw = arg_specs.random_inputs(jax.random.key(0), shape=shape, v=v)
    ba = pk.IMPLEMENTATION.bind(*args, **kw)
    assert ba.heuristics_config in pk.IMPLEMENTATION._get_autotuning_configs(ba)  # pylint: disable=protected-access
  ba = pk.IMPLEMENTATION.bind(*arg_specs.random_inputs(
      jax.random.key(0), shape=(1, 4096, 4096), v=128)[0])
  assert ba.heuristics_config == pk.Config(block_rows=128)   # 1 MiB of bf16 rows of 4096


def test_float16_falls_through():
  args, kw = arg_specs.random_inputs(jax.random.key(0), shape=(4, 128), dtype=jnp.float16)
  with config.interpret_mode(True), pytest.raises(NotImplementedError, match="float16"):
    gated_rmsnorm(*args, implementation="pallas_mosaic_tpu", **kw)
  y = gated_rmsnorm(*args, implementation=("pallas_mosaic_tpu", "xla"), **kw)
  assert y.dtype == jnp.float16
