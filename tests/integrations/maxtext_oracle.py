"""An oracle of MaxText's `jax_chunk_gated_delta_rule`, for the tests.

Provenance: written for these tests from the definition of
`jax_chunk_gated_delta_rule` in MaxText 0.2.5 (`maxtext/models/qwen3.py`, PyPI
wheel `maxtext==0.2.5`), not copied from it: the same chunked WY algebra and
the same points where MaxText casts (q/k L2-normalised in their own dtype with
eps 1e-6, then q, k, v, beta to `compute_dtype` and g to float32; q scaled by
K**-0.5 rounded to `compute_dtype`; the WY factors U and W rounded to
`compute_dtype`; states and accumulations float32; out in query's dtype; the
final state only with an initial state, in `compute_dtype`). q/k must already
be repeated to the value heads, as MaxText's function needs them.
"""

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _l2norm(x, eps=1e-6):
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + jnp.asarray(eps, x.dtype))


def maxtext_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
                                   initial_state=None, use_qk_norm_in_gdn=False,
                                   compute_dtype=jnp.bfloat16):
  out_dtype = query.dtype
  if use_qk_norm_in_gdn:
    query, key = _l2norm(query), _l2norm(key)
  cd = jnp.dtype(compute_dtype)
  q, k, v, bt = (x.astype(cd) for x in (query, key, value, beta))
  g = g.astype(jnp.float32)
  q = q * jax.lax.rsqrt(jnp.float32(q.shape[-1])).astype(cd)
  b, t, h, dk = k.shape
  dv = v.shape[-1]
  c = chunk_size
  n = -(-t // c)
  pad = n * c - t

  def chunks(x):   # [B, T, H, ...] -> [N, B, H, C, ...], zero-padded at the end
    x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
    x = x.reshape(b, n, c, h, *x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)

  qc, kc, vc, gc, bc = (chunks(x) for x in (q, k, v, g, bt))
  gcum = jnp.cumsum(gc, axis=-1)                                      # [N, B, H, C]
  strict = jnp.tril(jnp.ones((c, c), bool), -1)
  causal = jnp.tril(jnp.ones((c, c), bool))
  diff = gcum[..., :, None] - gcum[..., None, :]
  # Decays exp(G_i - G_j), masked BEFORE the exp (never exp of a positive gap).
  decay_strict = jnp.where(strict, jnp.exp(jnp.where(strict, diff, -1e30)), 0.0)
  decay_causal = jnp.where(causal, jnp.exp(jnp.where(causal, diff, -1e30)), 0.0)
  kbeta = kc * bc[..., None]
  a = jnp.einsum("nbhik,nbhjk->nbhij", kbeta, kc, precision=_HI).astype(jnp.float32)
  a = a * decay_strict
  eye = jnp.broadcast_to(jnp.eye(c, dtype=jnp.float32), a.shape)
  tinv = jax.scipy.linalg.solve_triangular(eye + a, eye, lower=True, unit_diagonal=True)
  u = jnp.einsum("nbhij,nbhjv->nbhiv", tinv, (vc * bc[..., None]).astype(jnp.float32),
                 precision=_HI).astype(cd)
  w = jnp.einsum("nbhij,nbhjk->nbhik", tinv,
                 kbeta.astype(jnp.float32) * jnp.exp(gcum)[..., None],
                 precision=_HI).astype(cd)

  s0 = (jnp.zeros((b, h, dk, dv), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def step(s, xs):
    q_, k_, u_, w_, gcum_, dc = xs
    v_new = u_.astype(jnp.float32) - jnp.einsum("bhik,bhkv->bhiv", w_.astype(jnp.float32), s,
                                                 precision=_HI)
    qk = jnp.matmul(q_, jnp.swapaxes(k_, -1, -2), precision=_HI).astype(jnp.float32) * dc
    o = (jnp.einsum("bhik,bhkv->bhiv", q_.astype(jnp.float32) * jnp.exp(gcum_)[..., None], s,
                    precision=_HI)
         + jnp.einsum("bhij,bhjv->bhiv", qk, v_new, precision=_HI))
    last = gcum_[..., -1]
    k_dec = k_.astype(jnp.float32) * jnp.exp(last[..., None] - gcum_)[..., None]
    s = s * jnp.exp(last)[..., None, None] + jnp.einsum("bhjk,bhjv->bhkv", k_dec, v_new,
                                                        precision=_HI)
    return s, o

  final, o = jax.lax.scan(step, s0, (qc, kc, u, w, gcum, decay_causal))
  o = jnp.moveaxis(jnp.moveaxis(o, 3, 2), 0, 1).reshape(b, n * c, h, dv)[:, :t]
  return o.astype(out_dtype), (None if initial_state is None else final.astype(cd))
