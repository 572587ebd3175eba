"""The pieces of a Qwen3.5-style decoder block, as pure functions on param dicts.

  rms_norm(x, w)   = x / sqrt(mean(x²) + eps) * (1 + w)       (f32; w starts at 0,
                                                              Qwen3-Next's zero-centred norm)
  attention(x)     = softmax(rope(q) rope(k)ᵀ / sqrt(d) + causal mask) v @ o
                     q = norm(x Wq), k = norm(x Wk), v = x Wv   (per head; GQA: query head
                     h reads key/value head h // (heads / kv_heads))
  moe(x)           = Σ_{e in topk(p)} w_e · down_e(silu(gate_e x) ⊙ up_e x),
                     p = softmax(x W_router), w = topk weights (renormalised to sum 1)

The MoE runs its experts as two grouped matmuls (`tokamax_gdn.gmm`): the
(token, expert) assignments are sorted by expert, so expert e owns one run of
rows whose length is the router's count for e (`group_sizes`); gmm's VJP is
gmm for the activations and tgmm for the expert weights. The router gets its
gradient through the routing weights w (top-k of a softmax is differentiable
in the selected values) and through the load-balancing loss.
"""

import functools
import math

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.gmm.api import gmm

Params = dict[str, jax.Array]


def normal(key, shape, dtype, std: float = 0.02) -> jax.Array:
  """HF's `initializer_range` init: N(0, std²)."""
  return (std * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """Zero-centred RMSNorm (Qwen3-Next / Qwen3.5): normalise and scale by
  (1 + weight) in float32, cast back to x's dtype."""
  x32 = x.astype(jnp.float32)
  x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w in x's dtype, accumulated in float32."""
  return jnp.matmul(x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(x.dtype)


# ----------------------------------------------------------------------------
# Causal softmax attention (the hybrid pattern's full-attention blocks).

def init_attention(key, hidden: int, heads: int, kv_heads: int, head_dim: int,
                   dtype) -> Params:
  kq, kk, kv, ko = jax.random.split(key, 4)
  return dict(
      q_proj=normal(kq, (hidden, heads * head_dim), dtype),
      k_proj=normal(kk, (hidden, kv_heads * head_dim), dtype),
      v_proj=normal(kv, (hidden, kv_heads * head_dim), dtype),
      o_proj=normal(ko, (heads * head_dim, hidden), dtype),
      q_norm=jnp.zeros((head_dim,), dtype),
      k_norm=jnp.zeros((head_dim,), dtype),
  )


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding on the last axis (halves rotated, as HF's `rotate_half`);
  x [..., T, H, D], positions [T]."""
  half = x.shape[-1] // 2
  freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions.astype(jnp.float32)[:, None] * freq               # [T, D/2]
  cos, sin = jnp.cos(angle)[:, None, :], jnp.sin(angle)[:, None, :]   # [T, 1, D/2]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


def attention_qkv(params: Params, x: jax.Array, positions: jax.Array, *, heads: int,
                  kv_heads: int, head_dim: int, eps: float, rope_theta: float):
  """x [..., T, hidden] at `positions` [T] -> q [..., T, heads, head_dim] and
  k, v [..., T, kv_heads, head_dim]: projected, q and k normed and rotated
  (what a KV cache stores)."""
  lead = x.shape[:-1]
  q = matmul(x, params["q_proj"]).reshape(*lead, heads, head_dim)
  k = matmul(x, params["k_proj"]).reshape(*lead, kv_heads, head_dim)
  v = matmul(x, params["v_proj"]).reshape(*lead, kv_heads, head_dim)
  q = rope(rms_norm(q, params["q_norm"], eps), positions, rope_theta)
  k = rope(rms_norm(k, params["k_norm"], eps), positions, rope_theta)
  return q, k, v


def attention(params: Params, x: jax.Array, *, heads: int, kv_heads: int, head_dim: int,
              eps: float, rope_theta: float) -> jax.Array:
  """Causal GQA softmax attention, x [B, T, hidden] -> [B, T, hidden]."""
  b, t, _ = x.shape
  q, k, v = attention_qkv(params, x, jnp.arange(t), heads=heads, kv_heads=kv_heads,
                          head_dim=head_dim, eps=eps, rope_theta=rope_theta)
  q = q.reshape(b, t, kv_heads, heads // kv_heads, head_dim)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32)
  s = s / math.sqrt(head_dim)
  causal = jnp.tril(jnp.ones((t, t), bool))
  s = jnp.where(causal, s, -jnp.inf)
  p = jax.nn.softmax(s, axis=-1).astype(x.dtype)
  o = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, preferred_element_type=jnp.float32)
  return matmul(o.astype(x.dtype).reshape(b, t, heads * head_dim), params["o_proj"])


# ----------------------------------------------------------------------------
# Routed mixture of SwiGLU experts on gmm.

def init_moe(key, hidden: int, experts: int, intermediate: int, dtype) -> Params:
  kr, kg, ku, kd = jax.random.split(key, 4)
  return dict(
      router=normal(kr, (hidden, experts), jnp.float32),   # routing runs in f32
      gate_proj=normal(kg, (experts, hidden, intermediate), dtype),
      up_proj=normal(ku, (experts, hidden, intermediate), dtype),
      down_proj=normal(kd, (experts, intermediate, hidden), dtype),
  )


def route(router: jax.Array, x: jax.Array, top_k: int, norm_topk_prob: bool):
  """Router probabilities [N, E], top-k weights [N, k] and experts [N, k]."""
  logits = jnp.matmul(x.astype(jnp.float32), router.astype(jnp.float32))
  probs = jax.nn.softmax(logits, axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if norm_topk_prob:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return probs, weights, experts


def capacity(tokens: int, top_k: int, experts: int, capacity_factor: float | None) -> int | None:
  """Rows each expert keeps (None: dropless)."""
  if capacity_factor is None:
    return None
  return max(1, math.ceil(capacity_factor * tokens * top_k / experts))


def sort_by_expert(experts: jax.Array, num_experts: int, cap: int | None):
  """Order of the flat (token, slot) assignments for gmm, and its group sizes.

  experts: [A] expert of each assignment (A = tokens * top_k, token-major).
  Returns (order [A], group_sizes [E] int32, kept [A] bool): `order` lists
  the kept assignments grouped by expert (token order within a group), then
  the dropped ones; group_sizes counts the kept ones, so sum(group_sizes) = A
  when dropless and < A when an expert overflowed its capacity `cap`.
  """
  n = experts.shape[0]
  order = jnp.argsort(experts, stable=True)
  counts = jax.ops.segment_sum(jnp.ones((n,), jnp.int32), experts, num_segments=num_experts)
  if cap is None:
    return order, counts.astype(jnp.int32), jnp.ones((n,), bool)
  starts = jnp.cumsum(counts) - counts
  sorted_experts = experts[order]
  rank = jnp.arange(n) - starts[sorted_experts]     # position within its expert's run
  kept_sorted = rank < cap
  # Dropped assignments move past every group (key E), keeping the rest in place.
  order = order[jnp.argsort(jnp.where(kept_sorted, sorted_experts, num_experts), stable=True)]
  kept = jnp.zeros((n,), bool).at[order].set(jnp.arange(n) < jnp.sum(kept_sorted))
  return order, jnp.minimum(counts, cap).astype(jnp.int32), kept


# The MoE's two row permutations with their VJPs written as gathers. Autodiff
# makes the VJP of a gather a scatter-add, which XLA:TPU compiles into a
# custom scatter fusion after sorting its indices: in the qwen3.5-tiny
# training step, four such scatters and eight sorts were among its largest
# computations to compile. Both permutations have an inverse at hand.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _expert_rows(x: jax.Array, order: jax.Array, inverse: jax.Array, top_k: int) -> jax.Array:
  """x[order // top_k]: each assignment's token row, in `order` (grouped by
  expert); `inverse` = argsort(order). VJP: the rows back in (token, slot)
  order by `inverse`, summed over each token's `top_k` slots."""
  del inverse
  return x[order // top_k]


def _expert_rows_fwd(x, order, inverse, top_k):
  return _expert_rows(x, order, inverse, top_k), inverse


def _expert_rows_bwd(top_k, inverse, d_rows):
  d = d_rows[inverse]
  return d.reshape(-1, top_k, d.shape[-1]).sum(axis=1, dtype=d.dtype), None, None


_expert_rows.defvjp(_expert_rows_fwd, _expert_rows_bwd)


@jax.custom_vjp
def _token_rows(ys: jax.Array, inverse: jax.Array, order: jax.Array) -> jax.Array:
  """ys[inverse]: the experts' output rows back in (token, slot) order. VJP:
  the cotangent's rows in expert order, by `order` (inverse's inverse)."""
  del order
  return ys[inverse]


def _token_rows_fwd(ys, inverse, order):
  return _token_rows(ys, inverse, order), order


def _token_rows_bwd(order, dy):
  return dy[order], None, None


_token_rows.defvjp(_token_rows_fwd, _token_rows_bwd)


def load_balancing_loss(probs: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
  """Switch / Qwen MoE auxiliary loss E · Σ_e f_e · P_e (1 when balanced):
  f_e the fraction of assignments routed to e, P_e the mean probability."""
  f = jax.ops.segment_sum(jnp.ones(experts.size, jnp.float32), experts.reshape(-1),
                          num_segments=num_experts) / experts.size
  return num_experts * jnp.sum(jax.lax.stop_gradient(f) * jnp.mean(probs, axis=0))


def moe(params: Params, x: jax.Array, *, top_k: int, capacity_factor: float | None = None,
        norm_topk_prob: bool = True, implementation=None, model_axis: str | None = None):
  """Routed SwiGLU experts; x [..., hidden] -> (y [..., hidden], stats).

  `stats`: `aux_loss` (load balancing, scalar), `group_sizes` [E] and
  `dropped` (assignments past capacity). With `model_axis` (inside
  `shard_map`) the experts' intermediate columns are split over that axis
  and the partial outputs summed across it.
  """
  shape = x.shape
  x = x.reshape(-1, shape[-1])
  tokens, num_experts = x.shape[0], params["router"].shape[-1]
  probs, weights, experts = route(params["router"], x, top_k, norm_topk_prob)
  flat = experts.reshape(-1)
  cap = capacity(tokens, top_k, num_experts, capacity_factor)
  order, group_sizes, kept = sort_by_expert(flat, num_experts, cap)
  inverse = jnp.argsort(order)
  xs = _expert_rows(x, order, inverse, top_k)             # [A, hidden], grouped by expert
  w_in = jnp.concatenate([params["gate_proj"], params["up_proj"]], axis=-1).astype(x.dtype)
  h = gmm(xs, w_in, group_sizes, implementation=implementation)
  gate, up = jnp.split(h, 2, axis=-1)
  h = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
  ys = gmm(h, params["down_proj"].astype(x.dtype), group_sizes, implementation=implementation)
  if model_axis is not None:
    ys = jax.lax.psum(ys, model_axis)
  # Back to (token, slot) order. Dropped assignments sit past sum(group_sizes),
  # where gmm writes zeros: no mask needed (the capacity test relies on it).
  y = _token_rows(ys, inverse, order).reshape(tokens, top_k, shape[-1])
  y = jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights)
  stats = dict(aux_loss=load_balancing_loss(probs, experts, num_experts),
               group_sizes=group_sizes, dropped=jnp.sum(~kept))
  return y.astype(x.dtype).reshape(shape), stats
