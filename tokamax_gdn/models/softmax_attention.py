"""The causal GQA softmax attention core: o = softmax(q kᵀ / sqrt(d) + causal) v.

q [B, T, H, D], k and v [B, T, KV, D]; query head h reads key/value head
h // (H / KV). Two ways to compute it:

  splash  jax's Pallas TPU flash attention (`jax.experimental.pallas.ops.tpu.
          splash_attention`), one MQA kernel per key/value head: that head's
          H / KV query heads against its keys and values, which are never
          repeated. The score matrix lives only in VMEM, block by block, and
          blocks above the diagonal are skipped.
  xla     the formula in jnp: the [B, KV, H/KV, T, T] scores in HBM, the
          causal mask as a select, XLA's softmax.

Why splash: at qwen3.5-tiny's attention (T = 4096, 8 query and 2 key/value
heads, D = 128, bf16) on the v5e chip it ran forward + backward several times
faster than the jnp formula and than tokamax 0.0.17's
`dot_product_attention(implementation="mosaic")` (which supports v5e), with
512-token blocks twice as fast as 256 (docs/performance.md, "Attention").

`causal_attention(..., implementation=...)` takes the model's
`implementation=`: splash where it names `pallas_mosaic_tpu` (or is None on
a TPU), the jnp formula for `xla` / `reference`. Splash needs T to be a
multiple of `SPLASH_BLOCKS`' smallest, and a TPU (or Pallas interpret mode,
`tokamax_gdn.config.interpret_mode`, where it runs on CPU); elsewhere the jnp
formula runs.
"""

import math

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask

from tokamax_gdn import config
from tokamax_gdn import registry

# Splash's query and key/value block sizes, most preferred first: the largest
# that divides T is used.
SPLASH_BLOCKS = (512, 256, 128)
SPLASH, XLA = "splash", "xla"
# The op name `registry.for_op` looks up in an `implementation=` dict.
OP_NAME = "attention"


def splash_block(t: int) -> int | None:
  """The splash block size for T tokens: the largest of `SPLASH_BLOCKS`
  dividing T, None when none does."""
  return next((b for b in SPLASH_BLOCKS if t % b == 0), None)


def _first_name(implementation):
  """The implementation name an `implementation=` argument tries first
  (None: the default; a tokamax Op counts as unnamed)."""
  impl = registry.for_op(implementation, OP_NAME)
  if impl is None or isinstance(impl, str):
    return impl
  first = next(iter(impl), None) if isinstance(impl, (list, tuple)) else impl
  return first if isinstance(first, str) else None


def core_for(implementation, t: int) -> str:
  """`SPLASH` or `XLA`: how `causal_attention` computes T tokens under
  `implementation=` (module docstring)."""
  name = _first_name(implementation)
  wants_kernels = config.on_tpu() if name is None else name == "pallas_mosaic_tpu"
  can_run = config.on_tpu() or config.interpret_enabled()
  return SPLASH if wants_kernels and can_run and splash_block(t) is not None else XLA


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """The jnp formula (module docstring); scores and softmax in float32."""
  b, t, heads, d = q.shape
  kv_heads = k.shape[2]
  q = q.reshape(b, t, kv_heads, heads // kv_heads, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
  s = s / math.sqrt(d)
  s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(q.dtype)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, preferred_element_type=jnp.float32)
  return o.astype(q.dtype).reshape(b, t, heads, d)


def _splash_kernel(t: int, group: int, block: int, interpret: bool):
  """The MQA splash kernel for `group` query heads over T tokens, causal.

  Built per call, not cached: it holds the mask's block metadata as jax
  arrays, which inside a trace are that trace's (splash caches the numpy
  work of `process_mask` itself)."""
  mask = splash_mask.MultiHeadMask([splash_mask.CausalMask((t, t)) for _ in range(group)])
  sizes = splash.BlockSizes(
      block_q=block, block_kv=block, block_kv_compute=block,
      block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
      block_q_dq=block, block_kv_dq=block)
  return splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
  """The splash kernels (module docstring); T a multiple of a `SPLASH_BLOCKS` size."""
  b, t, heads, d = q.shape
  kv_heads = k.shape[2]
  block = splash_block(t)
  if block is None:
    raise ValueError(f"splash attention needs T a multiple of {SPLASH_BLOCKS[-1]}; got T={t}.")
  kernel = _splash_kernel(t, heads // kv_heads, block, not config.on_tpu())
  # Splash takes unscaled logits: the scale goes on q (in its dtype).
  q = (q * (1.0 / math.sqrt(d))).astype(q.dtype)
  q = q.reshape(b, t, kv_heads, heads // kv_heads, d).transpose(0, 2, 3, 1, 4)  # [B, KV, G, T, D]
  k, v = (x.transpose(0, 2, 1, 3) for x in (k, v))                             # [B, KV, T, D]
  o = jax.vmap(jax.vmap(kernel))(q, k, v)                                       # [B, KV, G, T, D]
  return o.transpose(0, 3, 1, 2, 4).reshape(b, t, heads, d)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                     implementation=None) -> jax.Array:
  """q [B, T, H, D], k and v [B, T, KV, D] -> o [B, T, H, D] in q's dtype:
  splash or the jnp formula as `core_for` decides (module docstring)."""
  if q.shape[2] % k.shape[2]:
    raise ValueError(f"query heads {q.shape[2]} must be a multiple of key/value heads"
                     f" {k.shape[2]}.")
  if core_for(implementation, q.shape[1]) == SPLASH:
    return splash_attention(q, k, v)
  return xla_attention(q, k, v)
