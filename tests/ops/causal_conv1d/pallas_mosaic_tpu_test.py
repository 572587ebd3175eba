"""The Pallas Mosaic TPU causal_conv1d: interpret mode on CPU vs the NumPy loop and
the reference (forward, VJP, state, segments, multi-tile), and AOT compiles for
real TPU generations at the Qwen3.5 shape."""

import functools
import os

# Other processes on the machine may hold libtpu (AOT compiles); share it.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top

from tokamax_gdn import aot  # pylint: disable=g-import-not-at-top
from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.causal_conv1d import api  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.causal_conv1d import arg_specs  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.causal_conv1d import pallas_mosaic_tpu as pallas  # pylint: disable=g-import-not-at-top
from tokamax_gdn.testing.specs import rel_rms  # pylint: disable=g-import-not-at-top

from .test_base import ConvTestBase, check_nan_isolation, fwd_and_vjp  # pylint: disable=relative-beyond-top-level,g-import-not-at-top


def _interpret():
  return config.interpret_mode(not config.on_tpu())


class TestPallasInterpret(ConvTestBase):
  IMPL = "pallas_mosaic_tpu"
  SPEC_TAG = "interpret"
  CUTS = (2,)          # interpret mode is slow; 2 < W-1 still spans state and x

  def context(self):
    return _interpret()


# Small tiles so that T and D span several tiles (halo across tile edges).
SMALL_TILES = pallas.IMPLEMENTATION.replace(config=pallas.Config(block_d=128, block_t=16))


@pytest.mark.parametrize("t,d,w,segments", [(37, 200, 4, 3), (21, 130, 9, 2)])
def test_multi_tile_vs_reference(t, d, w, segments):
  args, kwargs = arg_specs.random_inputs(jax.random.key(t), b=2, t=t, d=d, w=w,
                                         segments=segments)
  x, weight, bias = args
  s0 = kwargs.pop("initial_state")

  def run(impl, x, weight, bias, s0):
    return api.causal_conv1d(x, weight, bias, initial_state=s0, implementation=impl, **kwargs)

  primals = (x, weight, bias, s0)
  shapes = jax.eval_shape(lambda *a: run("reference", *a), *primals)
  cot = jax.tree.map(lambda r: jax.random.normal(jax.random.key(9), r.shape), shapes)
  vjp_of = lambda impl: jax.jit(functools.partial(
      fwd_and_vjp, lambda *a: run(impl, *a)))(primals, cot)
  ref, ref_grads = vjp_of("reference")
  with _interpret():
    out, grads = vjp_of(SMALL_TILES)
  assert rel_rms(out[0], ref[0]) < 2e-4
  np.testing.assert_array_equal(out[1], ref[1])
  for n, g, rg in zip(("x", "weight", "bias", "initial_state"), grads, ref_grads):
    assert rel_rms(g, rg) < 2e-3, n


def test_nan_in_one_segment_stays_there_across_tiles():
  """Segments crossing 16-token tiles (the halos carry the poison's neighbours)."""
  with _interpret():
    check_nan_isolation(functools.partial(api.causal_conv1d, implementation=SMALL_TILES))


def test_off_tpu_without_interpret_falls_through():
  if config.on_tpu():
    pytest.skip("on a TPU the kernel runs")
  x = jnp.ones((1, 4, 8))
  with config.interpret_mode(False):
    with pytest.raises(NotImplementedError):
      api.causal_conv1d(x, jnp.ones((8, 4)), implementation="pallas_mosaic_tpu")
    y, _ = api.causal_conv1d(x, jnp.ones((8, 4)), implementation=("pallas_mosaic_tpu", "xla"))
  assert y.shape == x.shape


def test_width_above_halo_not_implemented():
  with _interpret(), pytest.raises(NotImplementedError):
    api.causal_conv1d(jnp.ones((1, 4, 8)), jnp.ones((8, 10)), implementation="pallas_mosaic_tpu")


def test_config_space():
  ba = pallas.IMPLEMENTATION.bind(jnp.zeros((1, 4096, 8192), jnp.bfloat16),
                                  jnp.zeros((8192, 4), jnp.bfloat16))
  assert pallas._heuristics(ba) == pallas.Config(block_d=512, block_t=256)  # pylint: disable=protected-access
  configs = pallas._autotuning_configs(ba)  # pylint: disable=protected-access
  assert len(configs) == 20 and pallas.Config(block_d=1024, block_t=1024) in configs
  with pytest.raises(Exception):
    pallas.Config(block_d=100)


@pytest.mark.aot
@pytest.mark.parametrize("target,segments", [("v6e", False), ("tpu7x", True)])
def test_aot_qwen_shape(target, segments):
  """D=8192 (Qwen3.5 / Qwen3-Next conv), T=4096, bf16, forward + backward."""
  def loss(x, w, seg):
    y, _ = api.causal_conv1d(x, w, segment_ids=seg if segments else None,
                             implementation="pallas_mosaic_tpu")
    return jnp.sum(y.astype(jnp.float32))

  rep = aot.compile_for(target, jax.value_and_grad(loss, argnums=(0, 1)),
                        ((1, 4096, 8192), jnp.bfloat16), ((8192, 4), jnp.bfloat16),
                        ((1, 4096), jnp.int32))
  # x, y / dx are 64 MiB each; nothing else of that size should be live.
  assert rep.temp_bytes < 160 << 20
