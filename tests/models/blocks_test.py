"""Decoder pieces against obvious dense formulations: the routed MoE on gmm
(dropless and with capacity), its gradients (router included), attention,
RoPE and the zero-centred RMSNorm."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn.models import blocks
from tokamax_gdn.testing.specs import rel_rms, tolerance

F32 = jnp.float32
H, E, I, K = 16, 4, 12, 2


def _rng_x(shape, seed):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), F32)


def _moe_params(seed=0):
  p = blocks.init_moe(jax.random.key(seed), H, E, I, F32)
  # Larger than the 0.02 init so outputs and gradients are far from zero.
  return jax.tree.map(lambda a: a * 20.0, p)


def _kept_assignments(experts: np.ndarray, cap: int | None) -> np.ndarray:
  """[N, k] bool: expert e keeps its first `cap` assignments in token order."""
  kept = np.ones(experts.shape, bool)
  if cap is None:
    return kept
  seen = np.zeros(E, int)
  for n in range(experts.shape[0]):
    for j in range(experts.shape[1]):
      e = experts[n, j]
      kept[n, j] = seen[e] < cap
      seen[e] += 1
  return kept


def dense_moe(params, x, kept=None):
  """Every expert on every token, combined with the routing weights (the
  obvious O(N·E) formulation)."""
  probs = jax.nn.softmax(x @ params["router"], axis=-1)
  w, e = jax.lax.top_k(probs, K)
  w = w / jnp.sum(w, axis=-1, keepdims=True)
  if kept is not None:
    w = w * kept
  combine = jnp.zeros(probs.shape).at[jnp.arange(x.shape[0])[:, None], e].add(w)
  h = jax.nn.silu(jnp.einsum("nh,ehi->eni", x, params["gate_proj"])) * jnp.einsum(
      "nh,ehi->eni", x, params["up_proj"])
  y = jnp.einsum("eni,eih->enh", h, params["down_proj"])
  return jnp.einsum("ne,enh->nh", combine, y)


@pytest.mark.parametrize("capacity_factor", [None, 0.5])
def test_moe_matches_dense_forward_and_grads(capacity_factor):
  params, x = _moe_params(), _rng_x((40, H), 1)
  experts = np.asarray(blocks.route(params["router"], x, K, True)[2])
  cap = blocks.capacity(40, K, E, capacity_factor)
  kept = _kept_assignments(experts, cap)
  y, stats = blocks.moe(params, x, top_k=K, capacity_factor=capacity_factor, implementation="xla")
  want = dense_moe(params, x, kept)
  assert rel_rms(y, want) < tolerance(F32, grad=False)
  counts = np.bincount(experts[kept], minlength=E)
  np.testing.assert_array_equal(stats["group_sizes"], counts)
  assert int(stats["dropped"]) == int((~kept).sum())
  if capacity_factor is not None:
    assert int(stats["dropped"]) > 0 and counts.sum() < 40 * K   # rows past sum(group_sizes)

  cot = _rng_x((40, H), 2)
  f = lambda p, x: jnp.sum(blocks.moe(p, x, top_k=K, capacity_factor=capacity_factor,
                                      implementation="xla")[0] * cot)
  g = lambda p, x: jnp.sum(dense_moe(p, x, kept) * cot)
  got, ref = jax.grad(f, argnums=(0, 1))(params, x), jax.grad(g, argnums=(0, 1))(params, x)
  for name in params:
    assert rel_rms(got[0][name], ref[0][name]) < tolerance(F32, grad=True), name
  assert rel_rms(got[1], ref[1]) < tolerance(F32, grad=True)
  assert float(jnp.abs(got[0]["router"]).max()) > 1e-3   # gradient reaches the router


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_moe_row_permutations_have_the_gathers_vjps(top_k):
  """The MoE's row permutations, whose VJPs gather by the inverse permutation
  (no scatter-add), give autodiff's gradients of the plain gathers."""
  r = np.random.default_rng(top_k)
  tokens, hidden = 6, 4
  x = jnp.asarray(r.standard_normal((tokens, hidden)), F32)
  order = jnp.asarray(r.permutation(tokens * top_k), jnp.int32)
  inverse = jnp.argsort(order)
  cot = jnp.asarray(r.standard_normal((tokens * top_k, hidden)), F32)
  rows = lambda x: jnp.sum(blocks._expert_rows(x, order, inverse, top_k) * cot)  # pylint: disable=protected-access
  plain = lambda x: jnp.sum(x[order // top_k] * cot)
  np.testing.assert_allclose(jax.grad(rows)(x), jax.grad(plain)(x), rtol=1e-6, atol=1e-6)
  back = lambda ys: jnp.sum(blocks._token_rows(ys, inverse, order) * cot)  # pylint: disable=protected-access
  np.testing.assert_array_equal(jax.grad(back)(cot), jax.grad(lambda ys: jnp.sum(ys[inverse] * cot))(cot))


def test_moe_bf16_within_bf16_tolerance_of_f32():
  params, x = _moe_params(), _rng_x((40, H), 3)
  y32, _ = blocks.moe(params, x, top_k=K, implementation="xla")
  y16, _ = blocks.moe(params, x.astype(jnp.bfloat16), top_k=K, implementation="xla")
  assert y16.dtype == jnp.bfloat16
  assert rel_rms(y16, y32) < tolerance(jnp.bfloat16, grad=False)


def test_sort_by_expert_groups_and_capacity():
  experts = jnp.array([2, 0, 2, 2, 1, 0, 2, 3, 2])
  order, sizes, kept = blocks.sort_by_expert(experts, 4, None)
  np.testing.assert_array_equal(sizes, [2, 1, 5, 1])
  np.testing.assert_array_equal(experts[order], [0, 0, 1, 2, 2, 2, 2, 2, 3])
  np.testing.assert_array_equal(order[:3], [1, 5, 4])              # token order within a group
  assert bool(kept.all())
  order, sizes, kept = blocks.sort_by_expert(experts, 4, 2)
  np.testing.assert_array_equal(sizes, [2, 1, 2, 1])
  np.testing.assert_array_equal(order[:6], [1, 5, 4, 0, 2, 7])     # kept, grouped
  np.testing.assert_array_equal(sorted(np.asarray(order[6:])), [3, 6, 8])  # dropped, last
  np.testing.assert_array_equal(kept, [1, 1, 1, 0, 1, 1, 0, 1, 0])


def test_load_balancing_loss_is_one_when_balanced():
  probs = jnp.full((8, 4), 0.25)
  experts = jnp.array([[0, 1], [2, 3]] * 4)
  assert float(blocks.load_balancing_loss(probs, experts, 4)) == pytest.approx(1.0)
  skewed = jnp.zeros((8, 4)).at[:, 0].set(1.0)
  assert float(blocks.load_balancing_loss(skewed, jnp.zeros((8, 2), int), 4)) == pytest.approx(4.0)


def test_rms_norm_zero_centred():
  x = _rng_x((3, 8), 4)
  w = _rng_x((8,), 5)
  want = x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + 1e-6) * (1 + w)
  np.testing.assert_allclose(blocks.rms_norm(x, w, 1e-6), want, rtol=1e-5, atol=1e-6)


def test_rope_relative_positions():
  q, k = _rng_x((1, 1, 1, 8), 6), _rng_x((1, 1, 1, 8), 7)
  at = lambda x, p: blocks.rope(x, jnp.array([p]), 10000.0)[0, 0, 0]
  np.testing.assert_allclose(jnp.linalg.norm(at(q, 5)), jnp.linalg.norm(q), rtol=1e-5)
  # <rope(q, m), rope(k, n)> depends on m - n only.
  np.testing.assert_allclose(jnp.dot(at(q, 7), at(k, 3)), jnp.dot(at(q, 14), at(k, 10)),
                             rtol=1e-4)
  np.testing.assert_allclose(at(q, 0), q[0, 0, 0])


def test_attention_matches_per_query_loop_and_is_causal():
  heads, kv_heads, d, t = 4, 2, 8, 7
  params = jax.tree.map(lambda a: a * 10, blocks.init_attention(jax.random.key(1), H, heads,
                                                                kv_heads, d, F32))
  params["q_norm"] = _rng_x((d,), 8) * 0.1
  x = _rng_x((2, t, H), 9)
  kw = dict(heads=heads, kv_heads=kv_heads, head_dim=d, eps=1e-6, rope_theta=10000.0)
  y = blocks.attention(params, x, **kw)

  q = (x @ params["q_proj"]).reshape(2, t, heads, d)
  k = (x @ params["k_proj"]).reshape(2, t, kv_heads, d)
  v = (x @ params["v_proj"]).reshape(2, t, kv_heads, d)
  pos = jnp.arange(t)
  q = blocks.rope(blocks.rms_norm(q, params["q_norm"], 1e-6), pos, 10000.0)
  k = blocks.rope(blocks.rms_norm(k, params["k_norm"], 1e-6), pos, 10000.0)
  out = np.zeros((2, t, heads, d), np.float32)
  for b in range(2):
    for h in range(heads):
      kh = h // (heads // kv_heads)
      for i in range(t):
        s = np.asarray(k[b, :i + 1, kh] @ q[b, i, h]) / np.sqrt(d)
        p = np.exp(s - s.max())
        out[b, i, h] = (p / p.sum()) @ np.asarray(v[b, :i + 1, kh])
  want = out.reshape(2, t, heads * d) @ np.asarray(params["o_proj"])
  assert rel_rms(y, want) < tolerance(F32, grad=False)

  x2 = x.at[:, 4:].set(_rng_x((2, t - 4, H), 10))
  np.testing.assert_allclose(blocks.attention(params, x2, **kw)[:, :4], y[:, :4], rtol=1e-6,
                             atol=1e-6)
