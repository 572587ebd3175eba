"""The MaxText adapter with `cp_axis`, as MaxText's layer calls it, against the oracle.

Usage: python -P tests/integrations/maxtext_cp_checks.py maxtext_cp OUT.json [CHECK ...]
(4 host CPU devices: XLA_FLAGS=--xla_force_host_platform_device_count=4), run in
a subprocess by `maxtext_test.test_context_parallel_matches_maxtext`.

MaxText's GatedDeltaNet shards T over its context axes inside `jax.shard_map`
(in_specs: q/k/v/g/beta split on T, the recurrent state replicated;
check_vma=False) and passes `cp_axis` as the tuple `gdn_context_axes` gives.
Each check does the same (T = 48: 12 tokens per device, under one chunk),
forward and VJP, and compares with the unsharded oracle of MaxText's
function (float32 contract).
"""

import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.sharding import PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from tests.integrations.maxtext_oracle import maxtext_chunk_gated_delta_rule as oracle  # pylint: disable=g-import-not-at-top,wrong-import-position
from tests.multidevice import sharding_checks as sc  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.integrations import maxtext  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.testing.specs import rel_rms, tolerance  # pylint: disable=g-import-not-at-top,wrong-import-position

CHECKS = {}
B, T, HK, HV, D, CHUNK = 2, 48, 1, 2, 16, 16


def _problem():
  r = np.random.default_rng(0)
  n = lambda *s: jnp.asarray(r.standard_normal(s).astype(np.float32))
  q, k, v = n(B, T, HK, D), n(B, T, HK, D), n(B, T, HV, D)
  g = jax.nn.log_sigmoid(n(B, T, HV) + 3.0)
  beta = jax.nn.sigmoid(n(B, T, HV))
  return q, k, v, g, beta, 0.1 * n(B, HV, D, D)


def _vjp(f, args):
  @jax.jit
  def run(args):
    outs, vjp = jax.vjp(f, *args)
    cts = jax.tree.map(lambda x: jax.random.normal(jax.random.key(1), x.shape, x.dtype), outs)
    return outs, vjp(cts)
  return run(args)


def _check(mesh_shape, axes, cp_axis, repeat):
  mesh = jax.make_mesh(mesh_shape, axes, axis_types=(jax.sharding.AxisType.Auto,) * len(axes))
  seq = P(None, axes)
  rep = lambda x: jnp.repeat(x, HV // HK, axis=2)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=(seq,) * 5 + (P(),),
                     out_specs=(seq, P()), check_vma=False)
  def sharded(q, k, v, g, beta, s0):
    if repeat:
      q, k = rep(q), rep(k)
    return maxtext.jax_chunk_gated_delta_rule(q, k, v, g, beta, CHUNK, s0, True, cp_axis,
                                              jnp.float32, implementation="xla")

  def unsharded(q, k, v, g, beta, s0):
    return oracle(rep(q), rep(k), v, g, beta, CHUNK, s0, True, jnp.float32)

  args = _problem()
  (got_o, got_s), got_g = _vjp(sharded, args)
  (want_o, want_s), want_g = _vjp(unsharded, args)
  errors = {"out": rel_rms(got_o, want_o), "state": rel_rms(got_s, want_s)}
  errors.update({f"d{n}": rel_rms(a, e)
                 for n, a, e in zip(("q", "k", "v", "g", "beta", "s0"), got_g, want_g)})
  bad = {n: e for n, e in errors.items()
         if e > tolerance(jnp.float32, grad=n.startswith("d"))}
  assert not bad, bad
  return {n: f"{e:.1e}" for n, e in errors.items()}


CHECKS["cp_axis_name"] = ("maxtext_cp", lambda: _check((4,), ("context",), "context", False))
# MaxText's form: a tuple of context axes, both live (2 x 2), q/k repeated.
CHECKS["cp_axis_tuple"] = ("maxtext_cp", lambda: _check(
    (2, 2), ("context", "context_usp_ulysses"), ("context", "context_usp_ulysses"), True))

if __name__ == "__main__":
  sc.main(sys.argv, CHECKS)
