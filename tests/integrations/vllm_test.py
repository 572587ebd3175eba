"""`tokamax_gdn.integrations.vllm.fused_conv1d_gdn` against our `reference`.

Fresh random inputs and random (non-zero) pools from the serving op's
layouts (`arg_specs.layout`, tokamax's request conventions scaled down for
CPU): decode batches (fresh and cached requests, padding), prefills and
continuations, mixed batches, verify windows followed by a prefill. The
drop-in runs the backend's default implementation (`xla` on CPU); every slot
and every output row is compared with the reference run on the same call.
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import causal_conv1d_gated_delta_rule
from tokamax_gdn.integrations import vllm
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.testing.specs import rel_rms, tolerance

TINY = dict(n_kq=1, n_v=2, d_k=16, d_v=16)
F32 = dict(dtype=jnp.float32, state_dtype=jnp.float32)

# tpu-inference 0.32.0's `kernels/gdn/v3/wrapper.py: fused_conv1d_gdn`, as
# read from its wheel: (name, kind, default); `EMPTY` where it has none.
EMPTY = inspect.Parameter.empty
POS, KW = inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY
VLLM_SIGNATURE = [
    *[(n, POS, EMPTY) for n in ("qkv", "b", "a", "conv_state", "recurrent_state", "conv_weight",
                                "conv_bias", "a_log", "dt_bias", "query_start_loc",
                                "state_indices", "distribution", "seq_lens",
                                "read_state_indices")],
    ("read_offsets", POS, None),
    *[(n, KW, EMPTY) for n in ("n_kq", "n_v", "d_k", "d_v", "kernel_size")],
    ("num_spec_tokens", KW, 0), ("zero_initialize_out", KW, True),
    ("compute_precision", KW, jnp.dtype(jnp.float32)), ("decode_tile_size", KW, 4),
    ("mixed_tile_size", KW, 64),
]


def _params(fn):
  return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def test_signature_is_vllms():
  assert _params(vllm.fused_conv1d_gdn) == VLLM_SIGNATURE


def test_signature_matches_the_installed_tpu_inference():
  """Where tpu-inference's files are on the path (the chip's bench carries
  its wheel), against its function itself."""
  try:
    kernel = vllm.tpu_inference_kernel()
  except ImportError:
    pytest.skip("tpu-inference is not on the path")
  assert _params(vllm.fused_conv1d_gdn) == _params(kernel)


def _call(lay, seed, offsets=None):
  """(positional args, keyword arrays, static sizes) of a fresh random call;
  `offsets` replaces read_offsets."""
  args, kwargs = arg_specs.random_call(jax.random.key(seed), lay)
  static = {k: v for k, v in kwargs.items() if k in arg_specs.STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
  if offsets is not None:
    arrays["read_offsets"] = jnp.asarray(offsets, jnp.int32)
  return list(args), arrays, static


def _dropin(args, arrays, static, **knobs):
  """The drop-in on copies of the pools (it donates them)."""
  args = list(args)
  args[3], args[4] = jnp.copy(args[3]), jnp.copy(args[4])
  reads = arrays.get("read_state_indices", args[10])
  return vllm.fused_conv1d_gdn(*args, reads, arrays.get("read_offsets"), **static, **knobs)


def _reference(args, arrays, static):
  return causal_conv1d_gated_delta_rule(*args, **arrays, **static, implementation="reference")


def _assert_close(got, want, dtype):
  (conv, rec), out = got
  (r_conv, r_rec), r_out = want
  tol = tolerance(dtype, grad=False)
  for name, x, y in (("out", out, r_out), ("recurrent", rec, r_rec), ("conv", conv, r_conv)):
    assert x.shape == y.shape and x.dtype == y.dtype, (name, x.shape, y.shape, x.dtype, y.dtype)
    assert rel_rms(x, y) <= tol, (name, rel_rms(x, y))


CASES = [
    # Decodes, fresh (context 0) and cached, two padding requests on slot 0.
    ("decode", dict(lengths=[1] * 5, context_lens=[3, 0, 5, 2, 0], max_reqs=7, **TINY, **F32)),
    # A prefill and a continuation of an earlier prefill.
    ("prefill", dict(lengths=[19, 23], context_lens=[0, 7], **TINY, **F32)),
    # Decodes beside prefills, bf16 activations and pools.
    ("mixed_bf16", dict(lengths=[1, 1, 13, 6], context_lens=[4, 4, 0, 9], max_reqs=6, **TINY)),
    # Verify windows of up to 4 tokens (read offsets cycling), then a prefill.
    ("spec3", dict(lengths=[4, 2, 1, 9], context_lens=[7, 7, 7, 0], num_spec_tokens=3,
                   **TINY, **F32)),
]


@pytest.mark.parametrize("name,kw", CASES, ids=[c[0] for c in CASES])
def test_against_reference(name, kw):
  del name
  lay = arg_specs.layout(**kw)
  args, arrays, static = _call(lay, seed=len(kw["lengths"]))
  _assert_close(_dropin(args, arrays, static), _reference(args, arrays, static),
                jnp.dtype(kw.get("dtype", jnp.bfloat16)))


def test_read_offsets_move_only_the_decode_segments_reads():
  """vLLM's kernel reads a prefill's state from its read slot whatever its
  offset; ours (tokamax's convention) adds the offset to every request's
  read slot: the drop-in zeroes the offsets past decode_end. Here the
  continuing prefill (request 2, slots 9..12) has offset 1: the drop-in
  matches the reference with that offset zeroed, not with it applied."""
  lay = arg_specs.layout(lengths=[4, 2, 9], context_lens=[7, 7, 5], num_spec_tokens=3,
                         **TINY, **F32)
  args, arrays, static = _call(lay, seed=3, offsets=[2, 1, 1])
  got = _dropin(args, arrays, static)
  _assert_close(got, _reference(args, arrays | dict(read_offsets=jnp.array([2, 1, 0])), static),
                jnp.float32)
  applied = _reference(args, arrays, static)
  assert rel_rms(got[1], applied[1]) > 0.1, "the prefill's offset changes nothing here"


def test_knobs_change_nothing():
  """zero_initialize_out=False, compute_precision=bfloat16 and other tiles:
  the same results (module doc), padding tokens' rows zero."""
  lay = arg_specs.layout(lengths=[1, 1, 13], context_lens=[2, 0, 3], **TINY, **F32)
  args, arrays, static = _call(lay, seed=5)
  # Two tokens no request owns.
  args[0] = jnp.concatenate([args[0], jnp.ones((2, args[0].shape[1]), args[0].dtype)])
  args[1], args[2] = (jnp.concatenate([x, jnp.ones((2, x.shape[1]), x.dtype)])
                      for x in args[1:3])
  base = _dropin(args, arrays, static)
  other = _dropin(args, arrays, static, zero_initialize_out=False,
                  compute_precision=jnp.bfloat16, decode_tile_size=16, mixed_tile_size=128)
  for x, y in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert not np.asarray(other[1][-2:]).any()


@pytest.mark.parametrize("knobs,message", [
    (dict(zero_initialize_out="yes"), "zero_initialize_out must be a bool"),
    (dict(compute_precision=jnp.int8), "compute_precision must be float32 or bfloat16"),
    (dict(compute_precision="fp8"), "compute_precision must be float32 or bfloat16"),
    (dict(decode_tile_size=0), "decode_tile_size must be a positive int"),
    (dict(decode_tile_size=True), "decode_tile_size must be a positive int"),
    (dict(mixed_tile_size=2.5), "mixed_tile_size must be a positive int"),
])
def test_bad_knobs_are_clear_errors(knobs, message):
  lay = arg_specs.layout(lengths=[1, 1], context_lens=1, **TINY, **F32)
  args, arrays, static = _call(lay, seed=1)
  with pytest.raises(ValueError, match=message):
    _dropin(args, arrays, static, **knobs)


@pytest.mark.parametrize("kw", [
    dict(lengths=[1] * 5, context_lens=[3, 0, 5, 2, 0], max_reqs=7),
    dict(lengths=[4, 2, 1, 3], context_lens=[7, 7, 7, 0], num_spec_tokens=3),
], ids=["decode", "spec3"])
def test_vllms_own_kernel_agrees(kw):
  """vLLM's kernel itself, where tpu-inference's files are on the path, in
  Pallas TPU interpret mode (traced for v5e), called as the benchmark calls
  it (`benchmarks.serving.op_call`), against our reference: the peer rows of
  the chip's table compute what ours do. Decodes and verify windows only:
  its prefill tiles use ref reshapes that interpret mode lacks."""
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  from tokamax_gdn import aot  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import serving  # pylint: disable=g-import-not-at-top
  try:
    vllm.tpu_inference_kernel()
  except ImportError:
    pytest.skip("tpu-inference is not on the path")
  # (Its kernel takes whole 128-lane heads.)
  lay = arg_specs.layout(**kw, n_kq=1, n_v=2, d_k=128, d_v=128, **F32)
  args, arrays, static = _call(lay, seed=11)
  rest = tuple(args[:3] + args[5:])
  with jax.sharding.use_abstract_mesh(aot.target_mesh("v5e").abstract_mesh), \
      pltpu.force_tpu_interpret_mode():
    got = serving.op_call(serving.VLLM, static)(jnp.copy(args[3]), jnp.copy(args[4]), rest,
                                                arrays)
  _assert_close(got, _reference(args, arrays, static), jnp.float32)
