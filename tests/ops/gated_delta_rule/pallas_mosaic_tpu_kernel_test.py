"""The Pallas GDN kernel's stages against the xla stages (and float64).

Each stage is called on the layout it has inside the kernels (heads in
sublanes, tokens in lanes), jitted on CPU (the stages are jnp/lax code; in
Pallas interpret mode they run the same ops, only ~100x slower), and checked
against the function of `xla_chunked_kernel` that computes the same quantity
of docs/gdn_math.md, or against float64 NumPy where the xla stage is less exact.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_kernel as pk
from tokamax_gdn.ops.gated_delta_rule import prologue
from tokamax_gdn.ops.gated_delta_rule import xla_chunked_kernel as xk

F32 = jnp.float32


def _call(fn, *args):
  return jax.tree.map(np.asarray, jax.jit(fn)(*args))


def _gates(seed, h, c, mode):
  r = np.random.default_rng(seed)
  g = -np.logaddexp(0.0, r.standard_normal((h, c)) - 1.0)
  if mode == "floor_then_tiny":   # docs/gdn_math.md: the in-chunk cumsum precision case
    g = np.where(np.arange(c) < c // 2, -29.5, -1e-5 * r.random((h, c)))
  elif mode == "zeros":
    g = np.where(r.random((h, c)) < 0.5, 0.0, g)
  return g.astype(np.float32)


def _starts(c, cuts):
  s = np.zeros((1, c), np.float32)
  s[0, list(cuts)] = 1.0
  return s


def _pallas_gate(g, starts, axis=1):
  """gcum, Γ per head, decay_in, decay_out, decay_chunk from the kernel's stages
  (g (H, C) and starts (1, C) given to the kernel as columns, tokens in
  sublanes, as its blocks arrive; `axis`: the cumsum's, see `chunk_gate`)."""
  h = g.shape[0]

  def stages(g, starts):
    gate = pk.chunk_gate(g.T, None if starts is None else starts.T, axis)
    gammas, dins = [], []
    for i in range(h):
      rows = (gate.g_hi[i:i + 1], gate.g_lo[i:i + 1], gate.run)
      gamma, din = pk.gamma_decay_in(rows, (gate.causal, gate.strict), 128)
      gammas.append(gamma)
      dins.append(din[:, 0])
    return (gate.g_hi + gate.g_lo, jnp.stack(gammas), jnp.stack(dins), gate.decay_out,
            gate.decay_chunk)

  return _call(stages, g, None if starts is None else jnp.asarray(starts))


def _float64_gamma(g, starts):
  h, c = g.shape
  seg = np.zeros(c, int) if starts is None else np.cumsum(starts[0]).astype(int)
  gcum = np.zeros((h, c))
  for i in range(c):
    begin = 0 if starts is None else max(j for j in range(i + 1) if j == 0 or starts[0, j])
    gcum[:, i] = np.sum(g[:, begin:i + 1].astype(np.float64), axis=1)
  mask = np.tril(np.ones((c, c), bool)) & (seg[:, None] == seg[None, :])
  diff = gcum[:, :, None] - gcum[:, None, :]
  return np.where(mask, np.exp(np.where(mask, diff, 0.0)), 0.0)


@pytest.mark.parametrize("axis", [1, 0], ids=["lanes", "sublanes"])
@pytest.mark.parametrize("c,cuts", [(64, None), (128, (0, 5, 77))], ids=["c64", "c128_segments"])
def test_chunk_gate_matches_xla_stage(c, cuts, axis):
  g = _gates(c, 2, c, "zeros")
  starts = None if cuts is None else _starts(c, cuts)
  gcum, gamma, din, dout, dch = _pallas_gate(g, starts, axis)
  ref = xk.chunk_gate(jnp.asarray(g), None if starts is None else jnp.asarray(starts[0] > 0))
  if starts is None:   # with segments, the kernel's gcum restarts at each start
    np.testing.assert_allclose(gcum, sum(ref.gcum), rtol=1e-5, atol=1e-5)   # (hi, lo)
  np.testing.assert_allclose(gamma, ref.gamma, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(din, ref.decay_in, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dout, ref.decay_out, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dch[:, 0], ref.decay_chunk, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("axis", [1, 0], ids=["lanes", "sublanes"])
def test_chunk_gate_keeps_tiny_gates_after_the_floor(axis):
  """Γ between the tiny-gate tokens after 64 tokens at the floor: the
  compensated cumsum keeps them to float32 precision (an f32 running sum at
  ~-1900 rounds 1e-5 steps to multiples of 1.2e-4)."""
  c = 128
  g = _gates(1, 2, c, "floor_then_tiny")
  _, gamma, *_ = _pallas_gate(g, None, axis)
  want = _float64_gamma(g, None)
  tail = slice(c // 2, c)
  err = np.max(np.abs(np.asarray(gamma)[:, tail, tail] - want[:, tail, tail]))
  assert err < 1e-6, err


@pytest.mark.parametrize("axis", [1, 0], ids=["lanes", "sublanes"])
def test_chunk_cumsum_restarts_at_segment_starts(axis):
  c, cuts = 128, (0, 3, 64, 65, 100)
  x = np.random.default_rng(2).standard_normal((8, c)).astype(np.float32)
  starts = _starts(c, cuts)

  if axis == 0:
    got = _call(lambda x, s: sum(pk.chunk_cumsum(x.T, s.T, axis=0)).T, x, starts)
  else:
    got = _call(lambda x, s: sum(pk.chunk_cumsum(x, s)), x, starts)
  bounds = list(cuts) + [c]
  want = np.zeros((8, c))
  for lo_, hi_ in zip(bounds[:-1], bounds[1:]):
    want[:, lo_:hi_] = np.cumsum(x[:, lo_:hi_].astype(np.float64), 1)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("c", [64, 128, 256])
@pytest.mark.parametrize("v5e_forms", [False, True], ids=["", "v5e_forms"])
@pytest.mark.parametrize("near_duplicates", [False, True])
@pytest.mark.parametrize("newton", [0, 1, 2])
def test_invert_unit_lower_matches_xla_stage(newton, near_duplicates, v5e_forms, c):
  """bf16 start + `newton` Newton steps against xla's substitution inverse
  (f32 HIGHEST): none for bf16 inputs (`default_newton`; one step is kept
  to a's bf16 floor and must not lose to it), two for float32; the same
  with the forms the kernels take on v5e; at every chunk size the kernels
  take (each merge level has its own blocks). Three matrices: a pair in one
  tile and one alone."""
  dk, h = 64, 3
  r = np.random.default_rng(newton + 2 * near_duplicates)
  k = r.standard_normal((h, c, dk))
  if near_duplicates:   # keys that repeat with small changes: ill-conditioned I + A
    k = np.repeat(k[:, : c // 8], 8, axis=1) + 0.05 * r.standard_normal((h, c, dk))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  beta = 1.0 / (1.0 + np.exp(-r.standard_normal((h, c, 1))))
  g = _gates(3, h, c, "zeros")
  gamma = _float64_gamma(g, None)
  a = np.tril(beta * (k @ np.swapaxes(k, -1, -2)) * gamma, -1).astype(np.float32)

  got = _call(lambda a: jnp.stack([t.T if transposed else t for t, transposed in
                                   pk.invert_unit_lower(list(a), newton=newton,
                                                        v5e_forms=v5e_forms)]), a)
  want = xk.invert_unit_lower(jnp.asarray(a), jax.lax.Precision.HIGHEST)
  exact = np.linalg.inv(np.eye(c) + a.astype(np.float64))
  err = np.linalg.norm(np.asarray(got) - exact) / np.linalg.norm(exact)
  xla_err = np.linalg.norm(np.asarray(want) - exact) / np.linalg.norm(exact)
  assert err < (2e-3 if newton <= 1 else 1e-5), (err, xla_err)
  np.testing.assert_allclose(got, want, atol=(2e-2 if newton <= 1 else 2e-4))


@pytest.mark.parametrize("v5e_forms", [False, True], ids=["", "v5e_forms"])
@pytest.mark.parametrize("pieces", [2, 3])
def test_rowsum_row_keeps_float32_precision(pieces, v5e_forms):
  x = np.random.default_rng(4).standard_normal((128, 256)).astype(np.float32)
  x[:, 0] *= 1e4

  got = _call(lambda x: pk.rowsum_row(x, pieces, v5e_forms), x)
  want = np.sum(x.astype(np.float64), axis=1)
  np.testing.assert_allclose(got[0], want, rtol=0, atol=2e-5 * np.abs(x).sum(1).max())


@pytest.mark.parametrize("v5e_forms", [False, True], ids=["", "v5e_forms"])
def test_rowsum_row_weighted_sums_exact_products(v5e_forms):
  """`weights`: the row sums of x ⊙ w, every product exact (w in three bf16
  pieces; a two-piece w would be off by ~2⁻¹⁶ of each term)."""
  r = np.random.default_rng(5)
  x = r.standard_normal((128, 256)).astype(np.float32)
  x[:, 0] *= 1e4
  w = r.random((1, 256)).astype(np.float32)

  got = _call(lambda x, w: pk.rowsum_row(x, 3, v5e_forms, weights=w), x, w)
  terms = x.astype(np.float64) * w.astype(np.float64)
  np.testing.assert_allclose(got[0], terms.sum(1), rtol=0,
                             atol=2e-6 * np.abs(terms).sum(1).max())


def test_round_bf16_is_a_nearest_bf16():
  """`round_bf16` (f32 arithmetic) gives a bf16 value exactly, its f32 copy
  equal to it, and a nearest one: the cast's, or its neighbour at a tie."""
  r = np.random.default_rng(5)
  x = (r.standard_normal(4096) * np.exp2(r.integers(-60, 60, 4096))).astype(np.float32)
  ties = np.float32(1.0) + np.float32(2.0 ** -8) * np.arange(1, 65, 2, dtype=np.float32)
  x = np.concatenate([x, ties, -ties, np.zeros(2, np.float32)])
  bf, wide = _call(pk.round_bf16, x)
  np.testing.assert_array_equal(bf.astype(np.float32), wide)
  cast = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).astype(np.float64)
  err, cast_err = np.abs(wide - x.astype(np.float64)), np.abs(cast - x)
  np.testing.assert_array_equal(err, cast_err)   # as near as the round-to-even cast
  assert np.mean(wide == cast) > 0.99
  exact = np.asarray(jnp.asarray(x).astype(jnp.bfloat16)).astype(np.float32)
  np.testing.assert_array_equal(_call(pk.round_bf16, exact)[1], exact)   # bf16 values stay


def _packed_inputs(seed, *, t, hk, hv, dk, dv, masked):
  """Packed qkv [1, T, 2 hk dk + hv dv], gates, state; beta and the log-decay 0
  at the `masked` tokens (the serving op's tokens of other requests)."""
  r = np.random.default_rng(seed)
  qkv = r.standard_normal((1, t, 2 * hk * dk + hv * dv)).astype(np.float32)
  g = -np.logaddexp(0.0, r.standard_normal((1, t, hv))).astype(np.float32)
  beta = (1.0 / (1.0 + np.exp(-r.standard_normal((1, t, hv))))).astype(np.float32)
  g[:, masked], beta[:, masked] = 0.0, 0.0
  h0 = (0.1 * r.standard_normal((1, hv, dk, dv))).astype(np.float32)
  return qkv, g, beta, h0


# Two requests sharing the first 64-token block (boundary at 40) and a
# partial last block (T = 80): the first continues pool slot 1 into slot 2,
# the second starts from zeros into slot 0; slot 3 is no one's.
_REQS = dict(start=[5, 40, 80], length=[35, 30, 0], init=[True, False, False],
             read=[1, 3, 0], write=[2, 0, 4])


def _requests_call(qkv, g, beta, pool, base, *, hk, hv, dk, dv, c):
  req = pk.PackedRequests(**{k: jnp.asarray(v, bool if k == "init" else jnp.int32)
                             for k, v in _REQS.items()})
  return jax.jit(lambda *a: pk.gdn_fwd_requests(
      *a[:4], req, a[4], hk=hk, hv=hv, dim_k=dk, dim_v=dv, scale=dk**-0.5, chunk=c,
      interleave=2, interpret=True))(*map(jnp.asarray, (qkv[0], g[0], beta[0], pool, base)))


def test_requests_forward_matches_gdn_fwd_on_prologue_inputs():
  """gdn_fwd_requests (q, k, v as lane ranges, L2 norm in-kernel, each request
  from its pool slot, its own rows only) = gdn_fwd per request on XLA's
  l2norm(q), l2norm(k) with the other tokens' q, k, v zeroed and their gates
  0; rows and slots of no request are `base`'s and the pool's, bit for bit."""
  hk, hv, dk, dv, t, c = 1, 2, 16, 16, 80, 64
  qkv, g, beta, _ = _packed_inputs(0, t=t, hk=hk, hv=hv, dk=dk, dv=dv, masked=[])
  r = np.random.default_rng(1)
  pool = (0.1 * r.standard_normal((4, hv, dk, dv))).astype(np.float32)
  base = r.standard_normal((t, hv * dv)).astype(np.float32)
  out, new_pool = _requests_call(qkv, g, beta, pool, base, hk=hk, hv=hv, dk=dk, dv=dv, c=c)
  kw = dict(scale=dk**-0.5, chunk=c, interleave=2, interpret=True)
  x = jnp.asarray(qkv)
  q = prologue.l2norm(x[..., :hk * dk].reshape(1, t, hk, dk))
  k = prologue.l2norm(x[..., hk * dk:2 * hk * dk].reshape(1, t, hk, dk))
  v = x[..., 2 * hk * dk:].reshape(1, t, hv, dv)
  mine = np.zeros(t, bool)
  for n in range(2):
    s, e = _REQS["start"][n], _REQS["start"][n] + _REQS["length"][n]
    own = np.zeros((1, t), bool)
    own[:, s:e] = True
    mine |= own[0]
    keep = own[..., None, None]
    h0 = pool[_REQS["read"][n]] if _REQS["init"][n] else np.zeros_like(pool[0])
    want, want_final, _ = pk.gdn_fwd(
        *(jnp.where(keep, y, 0.0) for y in (q, k, v)), jnp.where(own[..., None], g, 0.0),
        jnp.where(own[..., None], beta, 0.0), initial_state=jnp.asarray(h0)[None], **kw)
    want = np.asarray(want).reshape(t, hv * dv)
    np.testing.assert_allclose(np.asarray(out)[s:e], want[s:e], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(new_pool[_REQS["write"][n]], want_final[0], rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(out)[~mine], base[~mine])
  np.testing.assert_array_equal(np.asarray(new_pool)[[1, 3]], pool[[1, 3]])


def test_requests_keep_other_tokens_out():
  """NaN, inf and huge values in the q, k, v and gates of tokens outside the
  requests change none of their output rows and final states, bit for bit."""
  hk, hv, dk, dv, t, c = 1, 2, 16, 16, 80, 64
  qkv, g, beta, _ = _packed_inputs(2, t=t, hk=hk, hv=hv, dk=dk, dv=dv, masked=[])
  pool = (0.1 * np.random.default_rng(3).standard_normal((4, hv, dk, dv))).astype(np.float32)
  base = np.zeros((t, hv * dv), np.float32)
  other = np.r_[0:5, 70:80]
  junk = np.array([np.nan, np.inf, -np.inf, 3e38, -3e38] * 100)
  bad = [x.copy() for x in (qkv, g, beta)]
  for x in bad:
    x[:, other] = junk[:x.shape[-1]]
  run = lambda a, b, d: _requests_call(a, b, d, pool, base, hk=hk, hv=hv, dk=dk, dv=dv, c=c)
  (out, new_pool), (ref, ref_pool) = run(*bad), run(qkv, g, beta)
  live = np.r_[5:70]
  np.testing.assert_array_equal(np.asarray(out)[live], np.asarray(ref)[live])
  np.testing.assert_array_equal(new_pool, ref_pool)
  assert np.all(np.isfinite(np.asarray(out)[live]))


@pytest.mark.parametrize("v5e_forms", [False, True], ids=["", "v5e_forms"])
@pytest.mark.parametrize("pieces", [1, 2])
def test_lane_rowsums_put_each_sum_in_its_lane(pieces, v5e_forms):
  """Row sums of two tiles in lanes 3 and 40 of one (C, 128) tile (the
  backward's d_gcum columns), zeros elsewhere: to bf16 rounding of the terms
  with one piece, to ~2⁻¹⁶ with two."""
  r = np.random.default_rng(5)
  x, y = (r.standard_normal((64, 128)).astype(np.float32) for _ in range(2))

  got = _call(lambda x, y: pk.lane_rowsums(x, 3, pieces, v5e_forms)
              + pk.lane_rowsums(y, 40, pieces, v5e_forms), x, y)
  want = np.zeros((64, 128))
  want[:, 3], want[:, 40] = x.astype(np.float64).sum(1), y.astype(np.float64).sum(1)
  tol = 2e-2 if pieces == 1 else 1e-4
  np.testing.assert_allclose(got, want, rtol=0, atol=tol * np.abs(x).sum(1).max() / 10)


@pytest.mark.parametrize("v5e_forms", [False, True], ids=["", "v5e_forms"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_rounded_bf16_pieces_sum_to_the_rounded_value(n, v5e_forms):
  """`rounded_bf16`: n bf16 pieces summing exactly to the f32 value returned,
  which is x to bf16 (n = 1), ~2⁻¹⁶ (n = 2) or exactly (n = 3)."""
  r = np.random.default_rng(6)
  x = (r.standard_normal((64, 128)) * np.exp2(r.integers(-20, 20, (64, 128)))).astype(np.float32)
  pieces, value = _call(lambda x: pk.rounded_bf16(x, n, v5e_forms), x)
  assert len(pieces) == n and all(p.dtype == jnp.bfloat16 for p in pieces)
  np.testing.assert_array_equal(sum(p.astype(np.float64) for p in pieces), value)
  np.testing.assert_allclose(value, x, rtol={1: 2 ** -8, 2: 2 ** -16, 3: 0}[n], atol=0)
  # Split again, the value gives pieces with the same exact sum.
  again = _call(lambda v: pk.split_bf16(v, n, v5e_forms), value)
  np.testing.assert_array_equal(sum(p.astype(np.float64) for p in again), value)


@pytest.mark.parametrize("v5e_forms", [False, True], ids=["", "v5e_forms"])
def test_lane_rowsums_weighted_sums_exact_products(v5e_forms):
  """`weighted`: the row sums of y ⊙ w (y and w exact in bf16) added in the
  lane, each product exact and summed in float32 (the backward's f ⊙ β, whose
  row sums must cancel against the column sums of the same terms)."""
  r = np.random.default_rng(7)
  x = r.standard_normal((128, 128)).astype(np.float32)
  y = np.asarray(jnp.asarray(r.standard_normal((128, 128)) * 1e3, jnp.bfloat16))
  w = np.asarray(jnp.asarray(r.random((1, 128)), jnp.bfloat16)).astype(np.float32)
  w_cols = np.zeros((128, 128), np.float32)
  w_cols[:, 9], w_cols[:, 10] = w[0], 7.0     # only lane 9's column is read

  got = _call(lambda x, y, w_cols: pk.lane_rowsums(x, 9, 2, v5e_forms, weighted=(y, w_cols)),
              x, y, w_cols)
  terms = y.astype(np.float64) * w.astype(np.float64)
  want = np.zeros((128, 128))
  want[:, 9] = x.astype(np.float64).sum(1) + terms.sum(1)
  np.testing.assert_allclose(got, want, rtol=0, atol=2e-6 * np.abs(terms).sum(1).max())
