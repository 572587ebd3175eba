"""Named residuals (`named_residuals=True`) under `jax.checkpoint` policies.

Gradients under each remat policy against the reference (xla, and Pallas in
interpret mode), at the float32 and bfloat16 contracts; `models.forward`'s
`remat_policy` against no remat; and, compiled for v6e, which kernels each
policy's grad program runs: saving the residuals must drop the backward's
states pass and the forward's rerun.
"""

import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import aot
from tokamax_gdn import config
from tokamax_gdn.benchmarks import workload
from tokamax_gdn.ops.gated_delta_rule import remat
from tokamax_gdn.testing import specs


@functools.cache
def _inputs(dtype):
  r = np.random.default_rng(0)
  b, t, hk, hv, dk, dv = 1, 40, 1, 2, 16, 16      # 40: a partial last chunk
  n = lambda *s: r.standard_normal(s).astype(np.float32)
  cast = lambda x: jnp.asarray(x, dtype)
  args = (cast(n(b, t, hk, dk)), cast(n(b, t, hk, dk)), cast(n(b, t, hv, dv)),
          cast(n(b, t, hv)), cast(1 / (1 + np.exp(-n(b, t, hv)))))
  kwargs = dict(initial_state=jnp.asarray(0.5 * n(b, hv, dk, dv)), a_log=jnp.asarray(0.5 * n(hv)),
                dt_bias=jnp.asarray(0.5 * n(hv)))
  seg = jnp.asarray((np.arange(t) >= 17).astype(np.int32)[None])   # two segments
  return args, kwargs, seg


def _grads(impl, policy, dtype):
  """Gradients of sum(out²) + <final, 1> (policy None: no jax.checkpoint)."""
  args, kwargs, seg = _inputs(dtype)

  def loss(args, kwargs):
    out, final = tokamax_gdn.gated_delta_rule(
        *args, **kwargs, segment_ids=seg, use_qk_l2norm=True, output_final_state=True,
        implementation=impl, named_residuals=policy is not None)
    return workload.step_loss(out) + jnp.sum(final)
  if policy is not None:
    loss = jax.checkpoint(loss, policy=remat.checkpoint_policy(policy))
  with config.interpret_mode(impl == "pallas_mosaic_tpu" and not config.on_tpu()):
    return jax.jit(jax.grad(loss, argnums=(0, 1)))(args, kwargs)


_expected = functools.cache(lambda dtype: _grads("reference", None, dtype))


# The named path: residuals kept or offloaded, and used as given (the
# recompute policy's rerun forward emits the same residuals as save's).
@pytest.mark.parametrize("impl,policy,dtype", [
    ("xla", remat.SAVE, jnp.float32),
    ("pallas_mosaic_tpu", remat.SAVE, jnp.float32),
    ("pallas_mosaic_tpu", remat.OFFLOAD, jnp.bfloat16),
])
def test_gradients_with_named_residuals_match_the_reference(impl, policy, dtype):
  expected, actual = _expected(dtype), _grads(impl, policy, dtype)
  tol = specs.tolerance(dtype, grad=True)
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
    assert a.shape == e.shape and specs.rel_rms(a, e) <= tol, specs.rel_rms(a, e)


def test_unknown_policy_is_refused():
  with pytest.raises(ValueError, match="save_gdn"):
    remat.checkpoint_policy("save_everything")


@pytest.mark.aot
def test_each_policy_runs_the_kernels_it_should_on_v6e():
  """The grad program of the layer's call per policy: saved (or offloaded)
  residuals leave one forward and the backward kernel; recompute reruns the
  forward, which emits the residuals: no states pass."""
  mesh = aot.target_mesh("v6e")
  s = workload.LayerShape(b=1, t=256, hk=1, hv=2, k=128, v=128)
  args = workload.abstract_inputs(s, NamedSharding(mesh, P()))
  calls, host = {}, {}
  for policy in remat.POLICIES:
    rep = aot.compile_for("v6e", workload.layer_fns(s, "pallas_mosaic_tpu", policy)[1], *args,
                          mesh=mesh)
    calls[policy], host[policy] = rep.pallas_calls, rep.host_temp_bytes
  assert calls[remat.SAVE] == calls[remat.OFFLOAD] == dict(gdn_fwd=1, gdn_bwd=1)
  assert calls[remat.RECOMPUTE] == dict(gdn_fwd=2, gdn_bwd=1)
  # Offloaded: at least the chunk-entry states (bf16 [B, NC, Hv, K, V]) live on host.
  assert host[remat.OFFLOAD] >= 2 * s.hv * s.k * s.v * 2 > host[remat.SAVE] == 0
