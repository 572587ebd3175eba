"""Decoder on a ("data", "model") mesh of 8 host CPU devices vs unsharded.

Run by `sharding_test.py` in a subprocess (XLA_FLAGS must give 8 host devices
before jax starts). Prints one JSON line: {check: "ok" | error text}.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh  # pylint: disable=g-import-not-at-top

from tokamax_gdn import layers  # pylint: disable=g-import-not-at-top
from tokamax_gdn import models  # pylint: disable=g-import-not-at-top
from tokamax_gdn.models import sharding  # pylint: disable=g-import-not-at-top
from tokamax_gdn.testing.specs import rel_rms  # pylint: disable=g-import-not-at-top

CFG = models.ModelConfig(
    gdn=layers.GatedDeltaNetConfig(hidden_size=32, num_k_heads=4, num_v_heads=8, head_k_dim=8,
                                   head_v_dim=8),
    num_layers=2, full_attention_interval=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, vocab_size=16)
B, T = 4, 12


def _loss(params, tokens, mesh):
  logits, stats = models.forward(params, tokens, CFG, implementation="xla", mesh=mesh)
  return jnp.mean(jnp.sin(logits)), (logits, stats)


def check_forward_and_grads():
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), (sharding.DATA, sharding.MODEL))
  params = models.init_params(jax.random.key(0), CFG)
  params = jax.tree.map(lambda a: a * 5 if a.ndim >= 3 else a, params)  # away from tiny init
  tokens = jax.random.randint(jax.random.key(1), (B, T), 0, CFG.vocab_size)
  fn = lambda m: jax.jit(jax.value_and_grad(lambda p, t: _loss(p, t, m), has_aux=True))
  (loss, (logits, stats)), grads = fn(None)(params, tokens)
  (loss_s, (logits_s, stats_s)), grads_s = fn(mesh)(params, tokens)
  errors = []
  if rel_rms(logits_s, logits) > 2e-5:
    errors.append(f"logits rel_rms {rel_rms(logits_s, logits):.2e}")
  if not np.array_equal(stats_s["group_sizes"], stats["group_sizes"]):
    errors.append("group sizes differ")
  for (path, g_s), g in zip(jax.tree_util.tree_leaves_with_path(grads_s), jax.tree.leaves(grads)):
    if rel_rms(g_s, g) > 2e-5:
      errors.append(f"grad {jax.tree_util.keystr(path)} rel_rms {rel_rms(g_s, g):.2e}")
  # Each data shard balances its own tokens: the aux loss is the shards' mean.
  aux = jax.jit(lambda p, t: models.forward(p, t, CFG, implementation="xla")[1]["aux_loss"])
  want_aux = np.mean([float(aux(params, tokens[i * 2:(i + 1) * 2])) for i in range(2)])
  if abs(float(stats_s["aux_loss"]) - want_aux) > 1e-5:
    errors.append(f"aux loss {float(stats_s['aux_loss'])} vs shard mean {want_aux}")
  if errors:
    raise AssertionError("; ".join(errors))


def check_generate_with_params_on_a_mesh():
  # Params replicated over the mesh (as after sharded training) and a cache
  # `init_cache` leaves uncommitted: `generate` compiles its steps with the
  # cache's layouts left to XLA and places the cache beside the params.
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), (sharding.DATA, sharding.MODEL))
  params = models.init_params(jax.random.key(0), CFG)
  placed = jax.device_put(params, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
  prompts = [[1, 2, 3], [4, 5]]
  want, want_logits = models.generate(params, prompts, CFG, 3, implementation="xla")
  got, got_logits = models.generate(placed, prompts, CFG, 3, implementation="xla")
  if not np.array_equal(got, want) or rel_rms(got_logits, want_logits) > 2e-5:
    raise AssertionError(f"tokens {got.tolist()} vs {want.tolist()}, logits rel_rms"
                         f" {rel_rms(got_logits, want_logits):.2e}")


CHECKS = {"forward_and_grads": check_forward_and_grads,
          "generate_with_params_on_a_mesh": check_generate_with_params_on_a_mesh}

if __name__ == "__main__":
  if len(jax.devices()) < 8:
    raise SystemExit("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
  results = {}
  for name, check in CHECKS.items():
    try:
      check()
      results[name] = "ok"
    except Exception:  # pylint: disable=broad-except
      results[name] = traceback.format_exc()[-3000:]
  print("RESULTS " + json.dumps(results))
  sys.exit(0)
