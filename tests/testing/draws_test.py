"""`tokamax_gdn.testing.draws`: a spec's inputs drawn as one program on the
host's CPU are the values its `make` draws eagerly (to the last bit of a
fused transcendental), placed as those are."""

import jax
import numpy as np
import pytest

from tokamax_gdn import registry
from tokamax_gdn.testing import draws


@pytest.mark.parametrize("op_name", ["gated_delta_rule", "causal_conv1d_gated_delta_rule"])
def test_one_host_program_draws_what_make_draws(op_name):
  spec = registry.arg_specs(op_name, "conformance")[1]
  eager = draws.draw(spec.make, 123, on_host=False)
  hosted = draws.draw(spec.make, 123, on_host=True)
  e_leaves, h_leaves = jax.tree.leaves(eager), jax.tree.leaves(hosted)
  assert len(e_leaves) == len(h_leaves)
  for e, h in zip(e_leaves, h_leaves):
    if isinstance(e, jax.Array):
      assert isinstance(h, jax.Array) and not h.committed and e.dtype == h.dtype
      np.testing.assert_allclose(np.asarray(h, np.float64), np.asarray(e, np.float64),
                                 rtol=1e-6, atol=0)
    else:
      assert h == e
