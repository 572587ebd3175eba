"""The attention cores a model could run at qwen3.5-tiny's shape, on a TPU:
the jnp formula (scores in HBM), tokamax's `dot_product_attention` (mosaic)
and jax's splash attention (MHA form, K/V broadcast per query head), forward
and forward + backward of sum(out²), with their compile time and error
against the jnp formula. It chose `models.softmax_attention`'s kernel
(docs/performance.md, `chip-attention`).

    python tools/attention_probe.py [T]        # default 4096
"""
import functools, json, math, sys, time, traceback
import jax, jax.numpy as jnp, numpy as np
from tokamax_gdn.benchmarks import timing

B, T, H, KV, D = 1, int(sys.argv[1]) if len(sys.argv) > 1 else 4096, 8, 2, 128
rng = np.random.default_rng(0)
q = jnp.asarray(rng.standard_normal((B, T, H, D)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.bfloat16)
v = jnp.asarray(rng.standard_normal((B, T, KV, D)), jnp.bfloat16)

def jnp_attn(q, k, v):
  b, t = q.shape[:2]
  qq = q.reshape(b, t, KV, H // KV, D)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qq, k, preferred_element_type=jnp.float32) / math.sqrt(D)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, preferred_element_type=jnp.float32)
  return o.astype(q.dtype).reshape(b, t, H, D)

def tok_attn(q, k, v):
  import tokamax
  return tokamax.dot_product_attention(q, k, v, is_causal=True, implementation="mosaic")

def splash(q, k, v, bq=512, bkv=512):
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
  mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(H // KV)])
  bs = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq,
                     block_kv_dkv=bkv, block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
  kern = sk.make_splash_mha_single_device(mask, block_sizes=bs)
  # GQA: per kv head, the group's query heads as the mha's heads
  qq = q[0].reshape(T, KV, H // KV, D).transpose(1, 2, 0, 3) / math.sqrt(D)  # [KV, G, T, D]
  kk = jnp.broadcast_to(k[0].transpose(1, 0, 2)[:, None], (KV, H // KV, T, D))
  vv = jnp.broadcast_to(v[0].transpose(1, 0, 2)[:, None], (KV, H // KV, T, D))
  o = jax.vmap(kern)(qq, kk, vv)   # [KV, G, T, D]
  return o.transpose(2, 0, 1, 3).reshape(1, T, H, D)

ref = jax.jit(jnp_attn)(q, k, v).astype(jnp.float32)
out = {}
for name, f in [("jnp", jnp_attn), ("tokamax_mosaic", tok_attn), ("splash512", splash),
                ("splash256", functools.partial(splash, bq=256, bkv=256))]:
  try:
    loss = lambda q, k, v: jnp.square(f(q, k, v).astype(jnp.float32)).sum()
    fwd = jax.jit(f); step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))
    t0 = time.time(); o = fwd(q, k, v).block_until_ready(); step(q, k, v)[0].block_until_ready()
    comp = time.time() - t0
    err = float(jnp.sqrt(jnp.mean((o.astype(jnp.float32) - ref) ** 2) / jnp.mean(ref ** 2)))
    out[name] = dict(fwd_ms=timing.wall_ms(fwd, q, k, v), step_ms=timing.wall_ms(step, q, k, v),
                     compile_s=round(comp, 1), rel_rms=err)
  except Exception as e:
    out[name] = dict(error=f"{type(e).__name__}: {e}"[:400])
  print(name, out[name], flush=True)
print(json.dumps(out))
