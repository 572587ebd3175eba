"""The reference serving op against tokamax's references (test_base)."""

import jax
import pytest

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.testing.specs import rel_rms

from . import test_base  # pylint: disable=relative-beyond-top-level
from .test_base import F32, TINY, ServingTestBase, expected  # pylint: disable=relative-beyond-top-level


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
  (args, _), (_, t_out), (_, r_out) = expected("fresh_decode_only", lay)
  assert rel_rms(r_out[:5], t_out[:5]) < 1e-5
  from tokamax._src.ops.causal_conv1d_gated_delta_rule import reference as tokamax_reference  # pylint: disable=g-import-not-at-top
  kwargs = {k: v for k, v in lay.items() if k in arg_specs.STATIC and k != "num_spec_tokens"}
  (_, _), raw = tokamax_reference.run_jax_gdn_attention_local_ref(
      *jax.tree.map(jax.numpy.asarray, args), **kwargs)
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


def test_window_oracle_under_jit_is_tokamax_eager_oracle():
  """The verify-window oracle runs under jit with the layout's concrete
  indices (`test_base.tokamax_oracle`): the same results as tokamax's
  token-by-token reference called as it is, eagerly, with the batch's own
  index arrays."""
  from tokamax._src.ops.causal_conv1d_gated_delta_rule import gdn_attention_test as tokamax_tests  # pylint: disable=g-import-not-at-top
  lay = arg_specs.layout(lengths=[4, 2, 1], context_lens=[9, 0, 3], num_spec_tokens=3,
                         max_reqs=4, **TINY, **F32)
  args, kwargs = test_base.make(lay, seed=17)
  static = {k: v for k, v in kwargs.items() if k in arg_specs.STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
  oracle = test_base.tokamax_oracle(lay)
  (conv, rec), out = jax.jit(lambda a, kw: oracle(a, kw | static))(args, arrays)
  full = dict(zip(arg_specs.POSITIONAL, args)) | kwargs
  (e_conv, e_rec), e_out = tokamax_tests.gdn_attention_spec_ref(
      **{n: full[n] for n in arg_specs.POSITIONAL[:11]}, read_offsets=full["read_offsets"],
      num_spec_seqs=int(lay["distribution"][0]), seq_lens=full["seq_lens"],
      **{n: v for n, v in static.items() if n != "num_spec_tokens"})
  for got, want in ((out, e_out), (rec, e_rec), (conv, e_conv)):
    assert rel_rms(got, want) < 1e-6
