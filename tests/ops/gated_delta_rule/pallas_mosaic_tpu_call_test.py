"""The Pallas GDN kernels' host wrappers: shared traces and the small grids' form.

Tracing only (`jax.make_jaxpr`, interpret mode): nothing is compiled or run.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_call as call
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_fwd_kernel as fwd_kernel


def _inputs(seed, b=1, t=64, hk=1, hv=2, d=128):
  r = np.random.default_rng(seed)
  normal = lambda *s: jnp.asarray(r.standard_normal(s), jnp.float32)
  return (normal(b, t, hk, d), normal(b, t, hk, d) * d**-0.5, normal(b, t, hv, d),
          -jnp.abs(normal(b, t, hv)), jax.nn.sigmoid(normal(b, t, hv)))


def _traces_of_two_calls(monkeypatch, second_length: int) -> int:
  """How many times the forward kernel's body is traced for a program with
  two gdn_fwd calls, the second at T = `second_length`."""
  traced = []
  body = fwd_kernel.fwd_kernel

  def counting(*refs, **kwargs):
    traced.append(1)
    return body(*refs, **kwargs)

  monkeypatch.setattr(fwd_kernel, "fwd_kernel", counting)
  a, b = _inputs(0), _inputs(1, t=second_length)
  fwd = lambda xs: call.gdn_fwd(*xs, scale=0.1, chunk=64, interleave=2, interpret=True)[0]
  jax.make_jaxpr(lambda a, b: (fwd(a), fwd(b)))(a, b)
  return len(traced)


@pytest.fixture(autouse=True)
def _fresh_cache():
  call.cache_calls(True)   # (also empties it)
  yield
  call.cache_calls(True)


def test_equal_kernel_calls_share_one_trace(monkeypatch):
  """A model's layers call the kernels with equal arguments: one trace."""
  assert _traces_of_two_calls(monkeypatch, 64) == 1


def test_calls_that_differ_are_traced_apart(monkeypatch):
  assert _traces_of_two_calls(monkeypatch, 128) == 2


def test_sharing_turned_off_traces_every_call(monkeypatch):
  call.cache_calls(False)
  assert _traces_of_two_calls(monkeypatch, 64) == 2


def test_block_index_maps_are_values():
  """Equal calls build equal BlockSpecs (what the shared trace is keyed by)."""
  rev = call.Chunks(8, reverse=True)
  assert call.block((None, 64, 256), "b", "c", 0, chunks=rev).index_map == call.block(
      (None, 64, 256), "b", "c", 0, chunks=call.Chunks(8, reverse=True)).index_map
  assert call.BlockIndex(("b", "c", 0), rev)(3, 2) == (3, 5, 0)
  assert call.BlockIndex(("b", 0, "c"), call.Chunks(8))(1, 2) == (1, 0, 2)


@pytest.mark.parametrize("steps,interleave,unroll", [
    (1, 4, False), (common.SMALL_GRID_STEPS, 4, False), (common.SMALL_GRID_STEPS + 1, 16, True),
    (None, 16, True)])
def test_small_grids_loop_over_few_heads(steps, interleave, unroll):
  """Up to SMALL_GRID_STEPS grid steps: the head groups in a loop of at most
  SMALL_GRID_INTERLEAVE heads; longer grids (or interpret mode, steps None)
  keep the interleave asked for and, off tpu7x, unroll."""
  with gdn_config.interpret_mode(False):
    gdn_config.set_target_chip("v5e")
    try:
      assert common.group_interleave(16, hv=32, group=2, steps=steps) == interleave
      assert common.unroll_groups(steps=steps) is unroll
      assert common.unroll_groups(backward=True, steps=steps) is unroll
    finally:
      gdn_config.set_target_chip(None)


def test_the_aot_reports_short_lengths_take_the_long_grids_form():
  """`tokamax-gdn aot` takes cycle estimates at short lengths and extrapolates
  them to T: at B = 1 and C = 128 those must compile the long grids' form."""
  import inspect  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.aot import gated_delta_rule as report_lib  # pylint: disable=g-import-not-at-top
  lengths = inspect.signature(report_lib.report).parameters["cycle_lengths"].default
  assert not any(common.small_grid(-(-t // 128)) for t in lengths)
