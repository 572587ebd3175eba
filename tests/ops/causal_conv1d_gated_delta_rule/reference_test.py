"""The reference serving op against tokamax's references (test_base)."""

import pytest

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.testing.specs import rel_rms

from .test_base import F32, TINY, ServingTestBase, expected, tokamax_oracle  # pylint: disable=relative-beyond-top-level


class TestReference(ServingTestBase):
  IMPL = "reference"
  PROPERTIES = False


def test_oracle_of_fresh_decode_only_batches():
  """tokamax's jitted reference reads a fresh request's conv slot in a
  decode-only batch (tokamax's tp8_decode_* workloads are such batches);
  the oracle zeroes those slots in its own inputs so that it computes fresh
  requests: then it agrees with ours, and unadjusted it would not (the
  on-chip tier's named workloads failed on this, ~100 % off)."""
  lay = arg_specs.layout(lengths=[1] * 5, max_reqs=6, **TINY, **F32)
  (args, _), (_, t_out), (_, r_out) = expected("fresh_decode_only", lay, *tokamax_oracle(lay))
  assert rel_rms(r_out[:5], t_out[:5]) < 1e-5
  from tokamax._src.ops.causal_conv1d_gated_delta_rule import reference as tokamax_reference  # pylint: disable=g-import-not-at-top
  kwargs = {k: v for k, v in lay.items() if k in arg_specs.STATIC and k != "num_spec_tokens"}
  (_, _), raw = tokamax_reference.run_jax_gdn_attention_local_ref(*args, **kwargs)
  assert rel_rms(r_out[:5], raw[:5]) > 0.1, "the departure this works around is gone"


class _ReferenceAsImplementation(ServingTestBase):
  IMPL = "reference"


@pytest.mark.parametrize("windows", [False, True], ids=["slots", "spec_windows"])
def test_slots_outside_the_pool_under_jit(windows):
  """The reference, too, leaves the pool alone and gives NaN rows for a
  request whose slots lie outside it (the property the implementations'
  shared test checks; the reference is not among them, being their oracle
  elsewhere)."""
  _ReferenceAsImplementation().test_slots_outside_the_pool_under_jit(windows)
