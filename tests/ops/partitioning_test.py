"""Tests for `ops.partitioning` (the multi-device behaviour is checked on 8
host devices in `multidevice/sharding_checks.py`: gdn_pallas_interpret_*_jit,
conv_pallas_interpret_channels_jit)."""

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.ops import partitioning


def test_rule_labels_value_heads():
  labels = partitioning._rule_labels  # pylint: disable=protected-access
  assert labels("b t hv v", key_heads=4, group=2) == "b t (h g) v"
  # Shardy rejects size-1 factors in a compound.
  assert labels("b t hv v", key_heads=1, group=4) == "b t hv v"
  assert labels("b t hv v", key_heads=4, group=1) == "b t h v"
  assert labels("b t h k", key_heads=4, group=2) == "b t h k"


def _fn(x, w):
  return x * w[None, None, :, None], jnp.sum(x, axis=(1, 3))


def test_single_device_jit_and_vmap_match_the_plain_function():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 5, 6, 3)).astype(np.float32))
  w = jnp.asarray(rng.standard_normal((6,)).astype(np.float32))
  wrapped = partitioning.per_batch_and_head(
      _fn, ["b t hv d", "hv"], ["b t hv d", "b hv"], key_heads=3, group=2)
  want = _fn(x, w)
  for got in (jax.jit(wrapped)(x, w), wrapped(x, w)):
    for a, b in zip(got, want):
      np.testing.assert_allclose(a, b, rtol=1e-6)
  # vmap has no custom_partitioning batching rule: the plain call is used.
  got = jax.vmap(wrapped)(x[None].repeat(2, 0), w[None].repeat(2, 0))
  np.testing.assert_allclose(got[0][1], want[0], rtol=1e-6)


def test_call_per_shard_passes_none_through_and_drops_none_results():
  seen = {}

  def body(a, b, c):
    seen.update(a=a is None, b=b is None, c=c is None)
    return a + 1, None, a * 2

  a = jnp.ones((2, 3, 4))
  out = partitioning.call_per_shard(
      body, dict(a=a, b=None, c=None), dict(a="b t h", b="b", c="h"),
      ["b t h", "b t h"], key_heads=4)
  assert seen == dict(a=False, b=True, c=True)
  assert len(out) == 2
  np.testing.assert_allclose(out[1], 2 * a)
