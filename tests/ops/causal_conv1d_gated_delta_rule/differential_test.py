"""Randomized differential check of the serving op against tokamax's oracles.

Random ragged batches (`random_batch`): decode requests (1 token, or verify
windows of 1..s+1 tokens with random read offsets), prefills and
continuations of random lengths (1, and not multiples of the xla path's
chunk or tile sizes), empty requests, padding requests past mixed_end (null
slot 0 or unused slots, garbage query_start_loc entries), tokens before the
first and past the last request, seq_lens above / equal to / below the token counts, requests
reading a slot other than the one they write, kernel_size 2..4, n_kq == n_v
and GVA 1:2 / 1:4, d_k != d_v, bf16 / f32 activations and pools (each pool
its own dtype), conv_bias or None.

Oracle (`tokamax_oracle`): tokamax 0.0.17's own eager per-request references
from its test module: `gdn_attention_spec_ref` for the verify windows, then
`gdn_attention_ref` for the other requests, as tokamax's
`test_spec_mode_checkpoints` composes them. Both leave every slot no valid
request writes untouched and zero the rows of tokens outside valid requests,
so everything is compared: outputs and every slot (the untouched ones bit for
bit). Batches without windows or read indirection are also compared with
tokamax's jitted `run_jax_gdn_attention_local_ref` (its op's reference) on
the valid tokens and written slots (it rewrites padding requests' slots,
which ours deliberately does not).

The suite runs a few hypothesis examples; `python -m
tests.ops.causal_conv1d_gated_delta_rule.differential_test N` runs N seeds by
hand.
"""

import contextlib
import dataclasses
import sys

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

tokamax_tests = pytest.importorskip(
    "tokamax._src.ops.causal_conv1d_gated_delta_rule.gdn_attention_test")
from tokamax._src.ops.causal_conv1d_gated_delta_rule import reference as tokamax_reference  # pylint: disable=g-import-not-at-top,wrong-import-position

from tokamax_gdn import config  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api  # pylint: disable=g-import-not-at-top,wrong-import-position
from tokamax_gdn.testing.specs import rel_rms, tolerance  # pylint: disable=g-import-not-at-top,wrong-import-position

STATIC = ("n_kq", "n_v", "d_k", "d_v", "kernel_size", "num_spec_tokens")


@dataclasses.dataclass
class Batch:
  """One random call: arrays, static sizes and what the contract compares."""

  args: dict
  static: dict
  written: set       # slots valid requests write
  n_valid: int       # min(mixed_end, R)
  n_decode: int


def random_batch(seed: int) -> Batch:
  """A random ragged batch meeting the op's preconditions (module doc)."""
  rng = np.random.default_rng(seed)
  n_kq = int(rng.choice([1, 2]))
  n_v = n_kq * int(rng.choice([1, 2, 4]))
  d_k, d_v = (int(x) for x in rng.choice([8, 16], 2))
  if rng.random() < 0.3:
    d_v = 24 if d_k == 8 else 8
  width = int(rng.integers(2, 5))
  s = int(rng.choice([0, 0, 1, 3]))
  window = s + 1
  n_dec = int(rng.integers(0, 5))
  n_pre = int(rng.integers(0 if n_dec else 1, 4))
  n_pad = int(rng.choice([0, 0, 1, 3]))
  dec_len = [int(rng.integers(1, window + 1)) for _ in range(n_dec)]
  pre_len = [int(rng.choice([0, 1, 2, 5, 17, 33, 70, int(rng.integers(1, 80))],
                            p=[.05, .15, .1, .1, .15, .15, .1, .2])) for _ in range(n_pre)]
  lengths = dec_len + pre_len
  n_valid = len(lengths)
  r = n_valid + n_pad
  lead = 2 if rng.random() < 0.1 else 0          # tokens before the first request
  qsl = (lead + np.concatenate([[0], np.cumsum(lengths)])).astype(np.int32)
  extra = int(rng.choice([0, 0, 1, 5]))
  t = max(int(qsl[-1]) + extra, 1)
  pad_qsl = (np.full(n_pad, qsl[-1]) if rng.random() < 0.5
             else rng.integers(0, t + 1, n_pad))           # garbage, as tokamax's [1] * 11
  qsl = np.concatenate([qsl, pad_qsl]).astype(np.int32)

  # Slots: each request owns `window` (decodes) or 1 consecutive slots; some
  # spare slots serve as split read slots; slot 0 is the null slot.
  spans = [window if i < n_dec else 1 for i in range(n_valid)]
  n_spare = int(rng.integers(0, 4))
  num_slots = 1 + sum(spans) + n_spare + int(rng.integers(0, 3))
  order = rng.permutation(n_valid)
  slots = np.zeros(r, np.int32)
  nxt = 1
  for i in order:
    slots[i] = nxt
    nxt += spans[i]
  spare = list(range(nxt, nxt + n_spare))
  written = set()
  for i in range(n_valid):
    if lengths[i]:
      written.update(range(slots[i], slots[i] + (lengths[i] if i < n_dec else 1)))
  for i in range(n_valid, r):                  # padding: null slot or an unused one
    unused = num_slots > nxt + n_spare and rng.random() < 0.5
    slots[i] = int(rng.integers(nxt + n_spare, num_slots)) if unused else 0
  ctx = [int(rng.choice([0, 0, 3, 40])) for _ in range(n_valid)]
  seq_lens = np.array([l + c if rng.random() < 0.85 else int(rng.integers(0, max(l, 1)))
                       for l, c in zip(lengths, ctx)] + list(rng.integers(-3, 9, n_pad)),
                      np.int32)

  # Reads: own slot (+ an offset into a verify window), or a spare slot.
  reads = slots.copy()
  offsets = np.zeros(r, np.int32)
  for i in range(n_valid):
    if i < n_dec and s:
      offsets[i] = int(rng.integers(0, window))
    elif spare and rng.random() < 0.3:
      target = int(rng.choice(spare))
      if rng.random() < 0.5:
        reads[i] = target
      else:
        offsets[i] = target - slots[i]
  split = bool(np.any(reads != slots))
  use_offsets = s > 0 or bool(np.any(offsets)) or rng.random() < 0.2

  dtype = rng.choice([jnp.float32, jnp.bfloat16])
  conv_dtype, rec_dtype = (rng.choice([jnp.float32, jnp.bfloat16]) for _ in range(2))
  dim = 2 * n_kq * d_k + n_v * d_v
  keys = iter(jax.random.split(jax.random.key(seed), 10))
  normal = lambda shape, scale=1.0, dt=dtype: (
      scale * jax.random.normal(next(keys), shape, jnp.float32)).astype(dt)
  bound = width ** -0.5
  n_dist = n_valid
  if n_pad == 0 and rng.random() < 0.3:
    n_dist = n_valid + int(rng.integers(1, 3))       # mixed_end past R: clamped
  args = dict(
      qkv=normal((t, dim)), b=normal((t, n_v)), a=normal((t, n_v)),
      conv_state=normal((num_slots, width - 1, dim), dt=conv_dtype),
      recurrent_state=normal((num_slots, n_v, d_k, d_v), 0.1, dt=rec_dtype),
      conv_weight=jax.random.uniform(next(keys), (dim, 1, width), jnp.float32, -bound,
                                     bound).astype(dtype),
      conv_bias=None if rng.random() < 0.3 else normal((dim,), 0.1),
      a_log=normal((n_v,), 0.5, dt=jnp.float32), dt_bias=normal((n_v,)),
      query_start_loc=jnp.asarray(qsl), state_indices=jnp.asarray(slots),
      distribution=jnp.array([n_dec, n_dec + int(rng.integers(0, n_pre + 1)), n_dist],
                             jnp.int32),
      seq_lens=jnp.asarray(seq_lens))
  if split:
    args["read_state_indices"] = jnp.asarray(reads)
  if use_offsets:
    args["read_offsets"] = jnp.asarray(offsets)
  static = dict(n_kq=n_kq, n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=width, num_spec_tokens=s)
  return Batch(args, static, written, n_valid, n_dec)


def tokamax_oracle(batch: Batch):
  """((conv, recurrent), out) from tokamax's eager references (module doc)."""
  a, st_ = batch.args, batch.static
  sizes = {k: st_[k] for k in STATIC[:5]}
  reads = np.asarray(a.get("read_state_indices", a["state_indices"]))
  reads = reads + np.asarray(a.get("read_offsets", np.zeros_like(reads)))
  common = {k: a[k] for k in ("conv_weight", "conv_bias", "a_log", "dt_bias")}
  qsl = np.asarray(a["query_start_loc"])
  conv, rec, out = a["conv_state"], a["recurrent_state"], None
  n_dec = batch.n_decode if st_["num_spec_tokens"] else 0
  if n_dec:
    slots = np.asarray(a["state_indices"])
    (conv, rec), out = tokamax_tests.gdn_attention_spec_ref(
        qkv=a["qkv"], b=a["b"], a=a["a"], conv_state=conv, recurrent_state=rec,
        query_start_loc=a["query_start_loc"], state_indices=a["state_indices"],
        read_offsets=jnp.asarray(reads - slots), num_spec_seqs=n_dec,
        seq_lens=a["seq_lens"], **common, **sizes)
  lo = int(qsl[n_dec])
  rest = slice(n_dec, batch.n_valid + 1)
  (conv, rec), rest_out = tokamax_tests.gdn_attention_ref(
      qkv=a["qkv"][lo:], b=a["b"][lo:], a=a["a"][lo:], conv_state=conv, recurrent_state=rec,
      query_start_loc=jnp.asarray(qsl[rest] - lo),
      state_indices=a["state_indices"][n_dec:batch.n_valid],
      read_state_indices=jnp.asarray(reads[n_dec:batch.n_valid]),
      distribution=jnp.array([0, 0, batch.n_valid - n_dec], jnp.int32),
      seq_lens=a["seq_lens"][n_dec:batch.n_valid], **common, **sizes)
  if out is None:
    out = jnp.zeros((a["qkv"].shape[0], rest_out.shape[1]), rest_out.dtype)
  out = out.at[lo:].set(rest_out)
  return (conv, rec), out


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


def _tol(batch: Batch) -> float:
  a = batch.args
  low = any(a[k].dtype == jnp.bfloat16 for k in ("qkv", "conv_state", "recurrent_state"))
  return tolerance(jnp.bfloat16 if low else jnp.float32, grad=False)


def _close(actual, expected, tol, what):
  err = rel_rms(actual, expected)
  assert err <= tol, f"{what}: rel-RMS {err:.3g} > {tol:.3g}"


def check(batch: Batch, impl: str, oracle=None) -> None:
  """Our `impl` on `batch` against tokamax's oracles (module doc)."""
  a = batch.args
  ((conv, rec), out) = jax.jit(lambda kw: api.causal_conv1d_gated_delta_rule(
      **kw, **batch.static, implementation=impl))(a)
  (t_conv, t_rec), t_out = oracle or tokamax_oracle(batch)
  tol = _tol(batch)
  assert out.shape == t_out.shape and out.dtype == a["qkv"].dtype
  assert conv.dtype == a["conv_state"].dtype and rec.dtype == a["recurrent_state"].dtype
  _close(out, t_out, tol, "out")
  n_tok = int(np.asarray(a["query_start_loc"])[batch.n_valid])
  np.testing.assert_array_equal(np.asarray(out[n_tok:], np.float32), 0.0)
  written = np.array(sorted(batch.written), np.int64)
  if written.size:
    _close(rec[written], t_rec[written], tol, "recurrent (written slots)")
    _close(conv[written], t_conv[written], tol, "conv (written slots)")
  others = np.array(sorted(set(range(rec.shape[0])) - batch.written), np.int64)
  np.testing.assert_array_equal(_bits(rec[others]), _bits(a["recurrent_state"][others]))
  np.testing.assert_array_equal(_bits(conv[others]), _bits(a["conv_state"][others]))
  # tokamax's op reference where it applies (no windows, no read indirection).
  # Its decode-only branch (decode_end == mixed_end) reads the conv slot even
  # for fresh requests (seq_lens <= tokens) and its conv mixes pool and
  # activation dtypes only when they agree; tokens before query_start_loc[0]
  # count as request 0's: compared where none of these applies.
  dist = np.minimum(np.asarray(a["distribution"]), a["state_indices"].shape[0])
  qsl = np.asarray(a["query_start_loc"])
  fresh = np.asarray(a["seq_lens"])[:batch.n_valid] <= np.diff(qsl[:batch.n_valid + 1])
  if (batch.static["num_spec_tokens"] == 0 and "read_state_indices" not in a
      and not np.any(np.asarray(a.get("read_offsets", 0)))
      and a["conv_state"].dtype == a["qkv"].dtype and not (dist[0] == dist[2] and fresh.any())
      and qsl[0] == 0):
    kw = {k: v for k, v in a.items() if k not in ("read_offsets",)}
    kw["distribution"] = jnp.asarray(dist)
    (o_conv, o_rec), o_out = jax.jit(lambda kw: tokamax_reference.run_jax_gdn_attention_local_ref(
        **kw, **{k: batch.static[k] for k in STATIC[:5]}))(kw)
    _close(out[:n_tok], o_out[:n_tok], tol, "out vs tokamax op reference")
    if written.size:
      _close(rec[written], o_rec[written], tol, "recurrent vs tokamax op reference")
      _close(conv[written], o_conv[written], tol, "conv vs tokamax op reference")


_ORACLES = {}


@pytest.mark.parametrize("impl", ["xla", "reference"])
@hypothesis.settings(max_examples=2, deadline=None, derandomize=True, database=None,
                     suppress_health_check=list(hypothesis.HealthCheck))
@hypothesis.given(seed=st.integers(0, 2**31 - 1))
def test_random_batches_against_tokamax(impl, seed):
  if seed not in _ORACLES:            # shared by both implementations
    batch = random_batch(seed)
    _ORACLES[seed] = batch, tokamax_oracle(batch)
  batch, oracle = _ORACLES[seed]
  check(batch, impl, oracle)


if __name__ == "__main__":
  # Hand run: python -m tests.ops.causal_conv1d_gated_delta_rule.differential_test
  # N [FIRST_SEED [impl..]]
  n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
  first = int(sys.argv[2]) if len(sys.argv) > 2 else 0
  impls = sys.argv[3:] or ["xla", "reference"]
  failures = 0
  for seed in range(first, first + n):
    b = random_batch(seed)
    orc = tokamax_oracle(b)
    for name in impls:
      try:
        # Pallas kernels run in interpret mode off TPU.
        with (config.interpret_mode() if name.startswith("pallas") else contextlib.nullcontext()):
          check(b, name, orc)
      except Exception as e:  # pylint: disable=broad-except
        failures += 1
        print(f"seed {seed} {name}: {type(e).__name__}: {str(e)[:400]}")
  print(f"{n} seeds x {impls}: {failures} failures")
