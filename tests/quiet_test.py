"""Quiet by default: an `xla` call on a machine without TPU chips does not start
libtpu (whose start-up prints errors), and a shape with no tuned config is a
DEBUG line, not tokamax's multi-line WARNING, for this package's ops."""

import importlib.util
import logging
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import tokamax_gdn

_XLA_CALL = """
import jax, jax.numpy as jnp
import tokamax_gdn as tg
x = jnp.ones((1, 8, 1, 16)); v = jnp.ones((1, 8, 2, 16))
g, beta = -jnp.ones((1, 8, 2)), jnp.full((1, 8, 2), 0.5)
out, _ = tg.gated_delta_rule(x, x, v, g, beta, implementation="xla")
print(jax.devices(), out.shape)
"""


def test_xla_call_without_tpu_chips_does_not_start_libtpu():
  from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
  if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    pytest.skip("this machine has TPU chips: libtpu is meant to start")
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not installed: nothing could start it")
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "JAX_FORCE_TPU_INIT")}
  proc = subprocess.run([sys.executable, "-c", _XLA_CALL], capture_output=True, text=True,
                        env=env, timeout=300, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "[CpuDevice(id=0)] (1, 8, 2, 16)" in proc.stdout
  for noise in ("Failed to find host bounds", "unexpected worker hostname", "libtpu"):
    assert noise not in proc.stderr, proc.stderr[-2000:]


def _capture_all(caplog):
  """DEBUG and up from every logger, absl's included (whose level another
  test's `tokamax-gdn train` run may have raised)."""
  caplog.set_level(logging.DEBUG)
  caplog.set_level(logging.DEBUG, logger="absl")


def test_cache_miss_of_our_op_is_a_debug_line(caplog):
  _capture_all(caplog)
  x = jnp.ones((1, 24, 1, 16)); v = jnp.ones((1, 24, 2, 16))  # a shape with nothing tuned
  g, beta = -jnp.ones((1, 24, 2)), jnp.full((1, 24, 2), 0.5)
  jax.block_until_ready(jax.jit(   # jitted: the lookup (and its miss) happens when traced
      lambda *a: tokamax_gdn.gated_delta_rule(*a, implementation="xla"))(x, x, v, g, beta))
  misses = [r for r in caplog.records if "autotuning cache miss" in r.getMessage().lower()]
  assert misses, "no cache-miss record at all: the check below would prove nothing"
  assert all(r.levelno == logging.DEBUG and r.name == "tokamax_gdn.autotuning.cache"
             for r in misses), [(r.name, r.levelname, r.getMessage()[:80]) for r in misses]
  assert all("\n" not in r.getMessage() for r in misses)


def test_cache_miss_of_our_vjp_op_is_a_debug_line(caplog):
  """VJP Ops without the shipped-cache mixin are ours too (their misses were
  tokamax's multi-line WARNING in `tokamax-gdn aot --train-step`)."""
  from tokamax_gdn.ops.causal_conv1d import pallas_mosaic_tpu as conv  # pylint: disable=g-import-not-at-top
  vjp_op = conv.PallasMosaicTpuCausalConv1dVjp()
  assert not isinstance(vjp_op, tokamax_gdn.autotuning.ShippedAutotuningCacheMixin)
  _capture_all(caplog)
  logging.getLogger("absl").warning("Autotuning cache miss for %s on %s with key %s", vjp_op,
                                    "TPU7x", '{"x": "bf16[1,128,128]"}')
  assert [(r.name, r.levelno) for r in caplog.records] == [
      ("tokamax_gdn.autotuning.cache", logging.DEBUG)], caplog.records
