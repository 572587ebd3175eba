"""A fresh request (seq_lens == its token count) starts from zeros, in every
batch composition: ours against tokamax 0.0.17's `xla` op (docs/serving.md,
"Fresh requests").

The op's documented rule, tokamax's and vLLM tpu-inference's alike, is
has_initial_state = seq_lens - query_lens > 0. tokamax's `xla` op (its
`reference.run_jax_gdn_attention_local_ref`) follows it in mixed batches but
not in decode-only ones (decode_end == mixed_end): its decode-only branch
(`ragged_conv1d_decode_only`) convolves with the conv slot's contents for
every request, fresh ones included. The same fresh one-token request, on the
same pools, then gives another output in a decode-only batch than beside a
prefill. Ours gives the same in both, and does not read its slots at all.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokamax._src.ops.causal_conv1d_gated_delta_rule import api as tokamax_api

from tokamax_gdn import causal_conv1d_gated_delta_rule
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.testing.specs import rel_rms

TINY = dict(n_kq=1, n_v=2, d_k=16, d_v=16, dtype=jnp.float32, state_dtype=jnp.float32)
# Four one-token decodes, request 1 fresh; then, for the mixed batch, a
# prefill after them (its 7 tokens appended).
DECODES = dict(lengths=[1] * 4, context_lens=[5, 0, 3, 2])
MIXED = dict(lengths=[1] * 4 + [7], context_lens=[5, 0, 3, 2, 0], num_decode=4)
FRESH = 1


def _batches():
  """(decode-only call, mixed call): the same four decodes and pools."""
  lay_d = arg_specs.layout(**DECODES, max_reqs=5, **TINY)
  lay_m = arg_specs.layout(**MIXED, **TINY)
  args_d, kw = arg_specs.random_call(jax.random.key(7), lay_d)
  args_m, _ = arg_specs.random_call(jax.random.key(8), lay_m)
  static = {k: v for k, v in kw.items() if k in arg_specs.STATIC}
  # The mixed call: the decodes' tokens, then the prefill's; the same pools.
  cat = lambda i: jnp.concatenate([args_d[i], args_m[i][4:]])
  args_m = (cat(0), cat(1), cat(2)) + tuple(args_d[3:9]) + tuple(args_m[9:])
  assert list(np.asarray(args_d[11])) == [4, 4, 4] and list(np.asarray(args_m[11])) == [4, 5, 5]
  return args_d, args_m, static


def _rows(result):
  return np.asarray(result[1][:4])


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_fresh_decode_starts_from_zeros_in_every_batch(impl):
  args_d, args_m, static = _batches()
  run = lambda args: causal_conv1d_gated_delta_rule(*args, **static, implementation=impl)
  ours_d, ours_m = _rows(run(args_d)), _rows(run(args_m))
  assert rel_rms(ours_d, ours_m) < 1e-5
  # Its slot's contents are not read: other pools, the same output row.
  other = list(args_d)
  slot = int(args_d[10][FRESH])
  other[3] = other[3].at[slot].set(7.0)
  other[4] = other[4].at[slot].set(-3.0)
  np.testing.assert_array_equal(_rows(run(other))[FRESH], ours_d[FRESH])

  tokamax = tokamax_api.IMPLEMENTATIONS["xla"]
  tok_d, tok_m = (_rows(tokamax(*a, **static)) for a in (args_d, args_m))
  cached = [r for r in range(4) if r != FRESH]
  # Beside a prefill, tokamax's op agrees with ours on every decode...
  assert rel_rms(tok_m, ours_m) < 1e-4
  # ...in a decode-only batch, on the cached ones only: the fresh one read
  # its conv slot there.
  assert rel_rms(tok_d[cached], ours_d[cached]) < 1e-4
  assert rel_rms(tok_d[FRESH], ours_d[FRESH]) > 0.1
