"""Compiles kernels for real TPU generations on CPU (through libtpu).

GDN part: `gated_delta_rule(implementation="pallas_mosaic_tpu")`, forward and
forward+backward (jax.grad of a scalar loss), Qwen3-Next linear-attention
shapes, bf16, heuristics config. A failed compile (bad block shape, layout,
VMEM overflow) fails the test. No cycle estimates here (they make libtpu's
compile time grow with the grid size); `tokamax-gdn aot` reports those.
"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import jax
import jax.numpy as jnp
import pytest

import tokamax_gdn
from tokamax_gdn import aot

pytestmark = pytest.mark.aot

_BF16, _F32 = jnp.bfloat16, jnp.float32

# (batch, seq_len, hk, hv, k=v)
GDN_SHAPES = [(1, 4096, 16, 32, 128), (1, 4100, 8, 8, 128)]


def _gdn_specs(b, t, hk, hv, d):
  return [((b, t, hk, d), _BF16), ((b, t, hk, d), _BF16), ((b, t, hv, d), _BF16),
          ((b, t, hv), _F32), ((b, t, hv), _BF16)]


def _gdn_fwd(q, k, v, g, beta):
  return tokamax_gdn.gated_delta_rule(q, k, v, g, beta, implementation="pallas_mosaic_tpu")[0]


def _gdn_fwd_bwd(q, k, v, g, beta):
  def loss(*args):
    return jnp.sum(_gdn_fwd(*args).astype(_F32) ** 2)
  return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)


@pytest.mark.parametrize("shape", GDN_SHAPES, ids=lambda s: "T{1}_hk{2}_hv{3}".format(*s))
@pytest.mark.parametrize("target", ["v5e", "v6e", "tpu7x"])
def test_gdn_pallas_mosaic_tpu_compiles(target, shape):
  specs = _gdn_specs(*shape)
  fwd = aot.compile_for(target, _gdn_fwd, *specs)
  fwd_bwd = aot.compile_for(target, _gdn_fwd_bwd, *specs)
  b, t, hk, hv, d = shape
  print(f"\n{target} {shape}: fwd {fwd}\nfwd+bwd {fwd_bwd}")
  # The forward keeps nothing per token beyond its output: temp is only the
  # padded/packed copies of the inputs (< 4x the inputs).
  assert fwd.temp_bytes < 4 * fwd.argument_bytes, fwd
  # fwd+bwd: chunk-entry states (f32 K·V per chunk of >= 64 tokens) + copies.
  states = b * hv * (-(-t // 64)) * d * d * 4
  assert fwd_bwd.temp_bytes < states + 6 * fwd_bwd.argument_bytes, fwd_bwd
