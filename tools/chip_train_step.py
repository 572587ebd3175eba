"""The training step's record on one TPU chip, in one process (the chip is
opened once): about 4-5 minutes on a v5e.

  python tools/chip_train_step.py [--skip-attention]

1. `tokamax-gdn train --model qwen3.5-tiny --batch 1 --seq-len 4096 --dtype
   bfloat16 --compare-impls pallas_mosaic_tpu,xla --top-ops 10`: the step
   time, MFU and split of both implementations, and where each one's device
   time goes.
2. `tokamax-gdn train --compare-impls pallas_mosaic_tpu,xla --top-ops 10`: the
   same at the train job's shapes (qwen3.5-micro, B = 128, T = 16, float32),
   where the Pallas GDN kernels run the batch folded into one row.
3. `tokamax-gdn train`: the train job itself, to its recall target.
4. The attention core at qwen3.5-tiny's shape (B = 1, T = 4096, 8 query and
   2 key/value heads, D = 128, bf16), forward and forward + backward of
   sum(out²): what the model runs (`models.softmax_attention`: splash's MQA
   kernel per key/value head), splash's MHA kernel on key/value heads
   repeated per query head, and the jnp formula. Skipped when the steps
   above took past `ATTENTION_DEADLINE_S`.

Each part prints its own table; a part that fails prints its error and the
next one runs. Exit code 1 if any part failed.
"""

import argparse
import functools
import math
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn import cli
from tokamax_gdn import config
from tokamax_gdn.cli import common
from tokamax_gdn.benchmarks import timing
from tokamax_gdn.models import softmax_attention

TINY = ["train", "--model", "qwen3.5-tiny", "--batch", "1", "--seq-len", "4096", "--dtype",
        "bfloat16", "--compare-impls", "pallas_mosaic_tpu,xla", "--top-ops", "10"]
MAIN_COMPARE = ["train", "--compare-impls", "pallas_mosaic_tpu,xla", "--top-ops", "10"]
MAIN = ["train"]
ATTENTION_DEADLINE_S = 250


def _splash_mha(q, k, v):
  """Splash's MHA kernel with each key/value head repeated for its query
  heads (the other GQA form), blocks as the model picks them."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # pylint: disable=g-import-not-at-top
  b, t, heads, d = q.shape
  kv_heads = k.shape[2]
  group, blk = heads // kv_heads, softmax_attention.splash_block(t)
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
  sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                        block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                        block_kv_dq=blk)
  kernel = sk.make_splash_mha_single_device(mask, block_sizes=sizes,
                                            interpret=not config.on_tpu())
  q = (q * (1.0 / math.sqrt(d))).astype(q.dtype).transpose(0, 2, 1, 3)
  k, v = (jnp.repeat(x, group, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
  return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)


def attention_table(b=1, t=4096, heads=8, kv_heads=2, d=128) -> None:
  """Part 4's table (module docstring); off TPU (a check of this script) only
  in interpret mode and at small shapes."""
  r = np.random.default_rng(0)
  q = jnp.asarray(r.standard_normal((b, t, heads, d)), jnp.bfloat16)
  k = jnp.asarray(r.standard_normal((b, t, kv_heads, d)), jnp.bfloat16)
  v = jnp.asarray(r.standard_normal((b, t, kv_heads, d)), jnp.bfloat16)
  ref = jax.jit(softmax_attention.xla_attention)(q, k, v).astype(jnp.float32)
  rows = []
  for name, f in (("model (splash MQA)", functools.partial(
                      softmax_attention.causal_attention, implementation="pallas_mosaic_tpu")),
                  ("splash MHA, K/V repeated", _splash_mha),
                  ("jnp formula", softmax_attention.xla_attention)):
    fwd = jax.jit(f)
    step = jax.jit(jax.value_and_grad(
        lambda q, k, v, f=f: jnp.sum(jnp.square(f(q, k, v).astype(jnp.float32))),
        argnums=(0, 1, 2)))
    out = fwd(q, k, v).astype(jnp.float32)
    jax.block_until_ready(step(q, k, v))
    err = float(jnp.sqrt(jnp.mean((out - ref) ** 2) / jnp.mean(ref ** 2)))
    rows.append(dict(core=name, fwd_ms=f"{timing.wall_ms(fwd, q, k, v):.3f}",
                     fwd_bwd_ms=f"{timing.wall_ms(step, q, k, v):.3f}",
                     rel_rms_vs_jnp=f"{err:.1e}"))
  print(f"attention core, B={b} T={t} H={heads} KV={kv_heads} D={d} bf16"
        f" (jax {jax.__version__}, {jax.devices()[0].device_kind})")
  common.print_table(rows, {"core": "core", "fwd_ms": "fwd ms",
                                "fwd_bwd_ms": "fwd+bwd ms", "rel_rms_vs_jnp": "rel-RMS vs jnp"})


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--skip-attention", action="store_true")
  args = p.parse_args()
  start, failed = time.perf_counter(), False
  for argv in (TINY, MAIN_COMPARE, MAIN):
    print(f"\n$ tokamax-gdn {' '.join(argv)}", flush=True)
    try:
      failed |= cli.main(argv) != 0
    except Exception:  # pylint: disable=broad-exception-caught
      traceback.print_exc()
      failed = True
    print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
  if args.skip_attention or time.perf_counter() - start > ATTENTION_DEADLINE_S:
    print("\nattention core table: skipped")
  else:
    print()
    try:
      attention_table()
    except Exception:  # pylint: disable=broad-exception-caught
      traceback.print_exc()
      failed = True
  print(f"[{time.perf_counter() - start:.0f} s]")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
