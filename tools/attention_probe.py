"""Causal GQA attention cores timed side by side on a TPU: forward and
forward + backward of sum(out²), compile seconds and error against the jnp
formula (`models.softmax_attention.xla_attention`). With no core named: the
cores `models.softmax_attention` chose between at qwen3.5-tiny's shape (the
jnp formula, tokamax's `dot_product_attention` (mosaic), splash's MHA form
with 512- and 256-token blocks; docs/performance.md, `chip-attention`).
`tools/chip_train_step.py` times the model's own core with `core_table`.

    python tools/attention_probe.py [T]        # default 4096
"""

import functools
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn import config
from tokamax_gdn.benchmarks import timing
from tokamax_gdn.cli import common
from tokamax_gdn.models import softmax_attention


def splash_mha(q, k, v, block=None):
  """Splash's MHA kernel with each key/value head repeated for its query
  heads (the other GQA form); blocks of `block` tokens, default as the model
  picks them (`softmax_attention.splash_block`)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm  # pylint: disable=g-import-not-at-top
  _, t, heads, d = q.shape
  group, blk = heads // k.shape[2], block or softmax_attention.splash_block(t)
  mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(heads)])
  sizes = sk.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk,
                        block_kv_dkv=blk, block_kv_dkv_compute=blk, block_q_dq=blk,
                        block_kv_dq=blk)
  kernel = sk.make_splash_mha_single_device(mask, block_sizes=sizes,
                                            interpret=not config.on_tpu())
  q = (q * (1.0 / math.sqrt(d))).astype(q.dtype).transpose(0, 2, 1, 3)
  k, v = (jnp.repeat(x, group, axis=2).transpose(0, 2, 1, 3) for x in (k, v))
  return jax.vmap(kernel)(q, k, v).transpose(0, 2, 1, 3)


def tokamax_mosaic(q, k, v):
  """tokamax's `dot_product_attention`, its mosaic implementation."""
  import tokamax  # pylint: disable=g-import-not-at-top
  return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")


def core_table(cores, b=1, t=4096, heads=8, kv_heads=2, d=128) -> list[dict]:
  """One row per (name, function) of `cores` at [b, t, heads / kv_heads, d]
  bf16: fwd and fwd+bwd ms (`timing.wall_ms`), compile s, rel-RMS against
  the jnp formula; a core that fails is a row with its error. Printed as a
  table, and returned."""
  r = np.random.default_rng(0)
  q = jnp.asarray(r.standard_normal((b, t, heads, d)), jnp.bfloat16)
  k = jnp.asarray(r.standard_normal((b, t, kv_heads, d)), jnp.bfloat16)
  v = jnp.asarray(r.standard_normal((b, t, kv_heads, d)), jnp.bfloat16)
  ref = jax.jit(softmax_attention.xla_attention)(q, k, v).astype(jnp.float32)
  rows = []
  for name, f in cores:
    try:
      fwd = jax.jit(f)
      step = jax.jit(jax.value_and_grad(
          lambda q, k, v, f=f: jnp.sum(jnp.square(f(q, k, v).astype(jnp.float32))),
          argnums=(0, 1, 2)))
      start = time.perf_counter()
      out = fwd(q, k, v).astype(jnp.float32)
      jax.block_until_ready(step(q, k, v))
      compile_s = time.perf_counter() - start
      err = float(jnp.sqrt(jnp.mean((out - ref) ** 2) / jnp.mean(ref ** 2)))
      rows.append(dict(core=name, fwd_ms=f"{timing.wall_ms(fwd, q, k, v):.3f}",
                       fwd_bwd_ms=f"{timing.wall_ms(step, q, k, v):.3f}",
                       compile_s=f"{compile_s:.1f}", rel_rms_vs_jnp=f"{err:.1e}"))
    except Exception as e:  # pylint: disable=broad-exception-caught
      rows.append(dict(core=name, error=f"{type(e).__name__}: {e}"[:300]))
  print(f"attention core, B={b} T={t} H={heads} KV={kv_heads} D={d} bf16"
        f" (jax {jax.__version__}, {jax.devices()[0].device_kind})")
  columns = {"core": "core", "fwd_ms": "fwd ms", "fwd_bwd_ms": "fwd+bwd ms",
             "compile_s": "compile s", "rel_rms_vs_jnp": "rel-RMS vs jnp", "error": "error"}
  common.print_table(rows, {c: h for c, h in columns.items() if any(c in r for r in rows)})
  return rows


def main() -> int:
  t = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
  rows = core_table([("jnp formula", softmax_attention.xla_attention),
                     ("tokamax dot_product_attention (mosaic)", tokamax_mosaic),
                     ("splash MHA, blocks 512", functools.partial(splash_mha, block=512)),
                     ("splash MHA, blocks 256", functools.partial(splash_mha, block=256))],
                    t=t)
  return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
