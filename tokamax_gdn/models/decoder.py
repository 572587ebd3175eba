"""A Qwen3.5-style hybrid decoder on tokamax_gdn's ops.

  x = embed[tokens]
  for each block i:                       (GDN, or attention every
    x = x + mixer_i(rms_norm(x))           `full_attention_interval`-th block)
    x = x + moe(rms_norm(x))
  logits = rms_norm(x) @ lm_head

Params are a dict: `embed` [V, hidden], `blocks`, `final_norm` [hidden] and
`lm_head` [hidden, V] (absent with tied embeddings). `blocks["gdn"]` holds the
GDN blocks' params with leaves stacked [num_periods, gdn_per_period, ...] and
`blocks["attention"]` the attention blocks' [num_periods, ...]: the layout
`lax.scan` walks. Block i of period p is `blocks["gdn"]` [p, i] for i <
gdn_per_period, then the attention block. A GDN block's `gdn` entry is
exactly `tokamax_gdn.layers.init_params`'s dict, so HF weights load through
`tokamax_gdn.layers.params_from_hf`.

`forward(..., scan=True)` runs the periods under `lax.scan` and the GDN
blocks of a period under an inner `lax.scan`, so one GDN block and one
attention block are compiled whatever the depth; `remat=True` wraps every
block in `jax.checkpoint` (activations inside a block are recomputed in the
backward; the GDN / gmm custom VJPs run inside the rematerialised region),
with the policy `remat_policy` names (`ops.gated_delta_rule.remat`):
"recompute" saves nothing; "save_gdn" / "offload_gdn" have the GDN op emit
its backward's residuals (chunk-entry states, WY inverses, its output, the
conv output) and keep them on device / in host memory, so the backward
neither reruns the GDN forward nor its states pass.
"""

import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from tokamax_gdn import layers
from tokamax_gdn import registry
from tokamax_gdn.models import blocks
from tokamax_gdn.models import sharding
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.ops.gated_delta_rule import remat as gdn_remat

Params = dict


def init_dt_bias(key: jax.Array, num_heads: int, dt_min: float = 1e-3,
                 dt_max: float = 0.1) -> jax.Array:
  """softplus⁻¹ of time steps dt log-uniform in [dt_min, dt_max] (Mamba2's init).

  HF's GDN init (dt_bias = 1, so dt = softplus(1) ≈ 1.3, with A up to 16)
  makes most heads decay by exp(−1.3·A) per token: they forget within a token
  or two, and a model trained from scratch must first unlearn that. With
  these dt the heads' memories span ~1 to ~10⁴ tokens from the start.
  """
  dt = jnp.exp(jax.random.uniform(key, (num_heads,), jnp.float32, jnp.log(dt_min),
                                  jnp.log(dt_max)))
  return dt + jnp.log(-jnp.expm1(-dt))


def init_block(key: jax.Array, cfg: ModelConfig, kind: str, dtype=jnp.float32) -> Params:
  """One block's params: normal(0.02) matrices and zero-centred norms at 0 as
  HF initialises them, the GDN layer's own init except `dt_bias` (see
  `init_dt_bias`)."""
  k_mix, k_moe, k_dt = jax.random.split(key, 3)
  h = cfg.hidden_size
  p = dict(input_norm=jnp.zeros((h,), dtype), post_norm=jnp.zeros((h,), dtype),
           moe=blocks.init_moe(k_moe, h, cfg.num_experts, cfg.moe_intermediate_size, dtype))
  if kind == "gdn":
    p["gdn"] = layers.init_params(k_mix, cfg.gdn, dtype)
    p["gdn"]["dt_bias"] = init_dt_bias(k_dt, cfg.gdn.num_v_heads)
  elif kind == "attention":
    p["attn"] = blocks.init_attention(k_mix, h, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      cfg.head_dim, dtype)
  else:
    raise ValueError(f"Unknown block kind {kind!r}; expected 'gdn' or 'attention'.")
  return p


def stack(trees):
  """Stacks a list of same-structured pytrees along a new leading axis."""
  return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def init_params(key: jax.Array, cfg: ModelConfig, dtype=jnp.float32) -> Params:
  """Random decoder params in `dtype` (the GDN gate params and the router stay
  float32 whatever `dtype`: both feed exp / softmax)."""
  k_embed, k_head, k_blocks = jax.random.split(key, 3)
  keys = jax.random.split(k_blocks, (cfg.num_periods, cfg.period))
  per_period = [[init_block(keys[i, j], cfg, kind, dtype) for j, kind in enumerate(cfg.period_kinds)]
                for i in range(cfg.num_periods)]
  n_gdn = cfg.gdn_per_period
  stacked = dict(gdn=stack([stack(blocks_[:n_gdn]) for blocks_ in per_period]))
  if cfg.period > n_gdn:
    stacked["attention"] = stack([blocks_[n_gdn] for blocks_ in per_period])
  params = dict(embed=blocks.normal(k_embed, (cfg.vocab_size, cfg.hidden_size), dtype),
                blocks=stacked, final_norm=jnp.zeros((cfg.hidden_size,), dtype))
  if not cfg.tie_word_embeddings:
    params["lm_head"] = blocks.normal(k_head, (cfg.hidden_size, cfg.vocab_size), dtype)
  return params


def block(params: Params, x: jax.Array, cfg: ModelConfig, kind: str, *,
          implementation=None, mesh: Mesh | None = None, named_residuals: bool = False):
  """One decoder block: x [B, T, hidden] -> (x, MoE stats)."""
  h = blocks.rms_norm(x, params["input_norm"], cfg.rms_norm_eps)
  if kind == "gdn":
    h = sharding.gdn_mixer(params["gdn"], h, cfg.gdn, implementation=implementation, mesh=mesh,
                           named_residuals=named_residuals)
  else:
    h = sharding.attention_mixer(params["attn"], h, heads=cfg.num_attention_heads,
                                 kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim,
                                 eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta,
                                 implementation=implementation, mesh=mesh)
  return mlp_residual(params, x + h, cfg, implementation=implementation, mesh=mesh)


def mlp_residual(params: Params, x: jax.Array, cfg: ModelConfig, *, implementation=None,
                 mesh: Mesh | None = None):
  """A block's second half, after the mixer: x -> (x + moe(rms_norm(x)), MoE stats)."""
  h = blocks.rms_norm(x, params["post_norm"], cfg.rms_norm_eps)
  h, stats = sharding.moe_mixer(
      params["moe"], h, top_k=cfg.num_experts_per_tok, capacity_factor=cfg.capacity_factor,
      norm_topk_prob=cfg.norm_topk_prob,
      implementation=registry.for_op(implementation, "gmm"), mesh=mesh)
  return x + h, stats


def forward(params: Params, tokens: jax.Array, cfg: ModelConfig, *, implementation=None,
            dtype=None, remat: bool = True, scan: bool = True, mesh: Mesh | None = None,
            remat_policy: gdn_remat.RematPolicy = gdn_remat.RECOMPUTE):
  """tokens [B, T] int -> (logits [B, T, V] float32, stats).

  Args:
    implementation: for every op (GDN, conv, gmm/tgmm, and the attention
      core, `models.softmax_attention`): a name, a sequence tried in order,
      or {op name: that} ("attention" for the core); None: the ops' defaults.
    dtype: activation dtype (default: the embedding's). Params are cast to it
      at use; GDN states, norms, softmaxes and accumulations stay float32.
    remat: `jax.checkpoint` around every block.
    remat_policy: with `remat`, what the blocks' checkpoints keep:
      "recompute" (nothing), "save_gdn" (the GDN residuals, on device) or
      "offload_gdn" (them, in pinned host memory); see the module docstring.
    scan: `lax.scan` over periods and over a period's GDN blocks instead of
      Python loops.
    mesh: a ("data", "model") mesh to shard over (see `models.sharding`).

  Returns:
    logits and a dict: `aux_loss` (router load balancing, mean over blocks),
    `group_sizes` [num_layers, E] (tokens per expert, summed over data shards)
    and `dropped` [num_layers] (assignments past capacity).
  """
  policy = gdn_remat.checkpoint_policy(remat_policy)   # checks the name
  if tokens.ndim != 2:
    raise ValueError(f"`tokens` (shape {tuple(tokens.shape)}): expected [B, T].")
  dtype = jnp.dtype(dtype or params["embed"].dtype)
  x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)

  def make(kind):
    fn = functools.partial(block, cfg=cfg, kind=kind, implementation=implementation, mesh=mesh,
                           named_residuals=remat)   # see workload.layer_fns
    fn = jax.checkpoint(fn, policy=policy) if remat else fn
    return lambda x, p: fn(p, x)       # (carry, xs) order for lax.scan

  gdn_block, attention_block = make("gdn"), make("attention")

  def loop(fn, x, stacked, n):
    """fn over the leading axis of `stacked`: lax.scan, or a Python loop."""
    if scan:
      return jax.lax.scan(fn, x, stacked)
    outs = []
    for i in range(n):
      x, out = fn(x, jax.tree.map(lambda a, i=i: a[i], stacked))
      outs.append(out)
    return x, stack(outs)

  def period(x, p):
    x, stats = loop(gdn_block, x, p["gdn"], cfg.gdn_per_period)       # leaves [n_gdn, ...]
    if "attention" in p:
      x, s = attention_block(x, p["attention"])
      stats = jax.tree.map(lambda a, b: jnp.concatenate([a, b[None]]), stats, s)
    return x, stats

  x, stats = loop(period, x, params["blocks"], cfg.num_periods)      # leaves [periods, period, ...]
  stats = jax.tree.map(lambda a: a.reshape((cfg.num_layers,) + a.shape[2:]), stats)

  x = blocks.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  logits = jnp.matmul(x, head.astype(dtype), preferred_element_type=jnp.float32)
  return logits, dict(aux_loss=jnp.mean(stats["aux_loss"]), group_sizes=stats["group_sizes"],
                      dropped=stats["dropped"])
