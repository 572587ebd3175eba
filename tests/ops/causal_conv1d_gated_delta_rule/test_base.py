"""Shared checks for every causal_conv1d_gated_delta_rule implementation.

A backend's test subclasses `ServingTestBase`, sets IMPL and may override
`context` (Pallas: interpret mode off TPU). Oracles, all on fresh random
inputs and random (non-zero) pools:
- tokamax 0.0.17's `reference.py` (installed with tokamax) for plain batches
  and its test module's token-by-token `gdn_attention_spec_ref` for verify
  windows; compared on the valid tokens and on the slots valid requests write
  (tokamax's reference also rewrites padding requests' slots, which ours must
  not);
- our `reference` implementation on the same batch (every slot);
- the op itself one token at a time (a verify window's checkpoints are the
  states of single-token decodes).
Shapes are tokamax's layouts (`arg_specs.layout`) scaled down for CPU.
"""

import contextlib
import threading

import jax
from jax._src import dispatch
import jax.numpy as jnp
import numpy as np
import pytest
from tokamax._src.ops.causal_conv1d_gated_delta_rule import gdn_attention_test as tokamax_tests
from tokamax._src.ops.causal_conv1d_gated_delta_rule import reference as tokamax_reference

from tokamax_gdn import config
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.testing import draws
from tokamax_gdn.testing.specs import rel_rms, tolerance
from tests import once

TINY = dict(n_kq=1, n_v=2, d_k=16, d_v=16)
F32 = dict(dtype=jnp.float32, state_dtype=jnp.float32)
STATIC = arg_specs.STATIC

# (id, layout keywords): tokamax's ci_tests layouts, scaled down for CPU and
# merged so that few compiles cover decode, prefill, mixed, padded batches,
# context > 0, GVA 1:4, d_k = d_v = 128, bf16 and f32 pools. At most 8
# requests each: the Pallas decode kernel unrolls its tile of requests
# (a multiple of 8), and in interpret mode a tile of 16 compiles twice as long
# (mixed_padded_ctx at 9 requests: 38 -> 19 CPU-s at 8).
CASES = [
    ("decode_only_ctx", dict(lengths=[1] * 4, context_lens=3, **TINY, **F32)),
    ("mixed_padded_ctx", dict(lengths=[1, 1, 1, 17, 6, 33], context_lens=[2, 2, 2, 0, 5, 0],
                              max_reqs=8, **TINY, **F32)),
    ("gva_1to4_bf16_pools", dict(lengths=[1, 1, 21], context_lens=[5, 5, 7], n_kq=1, n_v=4,
                                 d_k=32, d_v=16)),
    ("dk128_f32_act_bf16_pools", dict(lengths=[1, 20], context_lens=[2, 0], n_kq=1, n_v=1,
                                      d_k=128, d_v=128, dtype=jnp.float32,
                                      state_dtype=jnp.bfloat16)),
]
SPEC_CASES = [
    ("spec3_padded_bf16", dict(lengths=[4, 3, 1, 2], context_lens=9, num_spec_tokens=3,
                               max_reqs=5, **TINY)),
]
_EXPECTED = once.Once()
_JITTED = {}
_JITTED_LOCK = threading.Lock()
# Where a case's inputs and oracles may come from instead (`set_oracle_source`).
_SOURCE = None


def expected(case_id, lay):
  """(inputs, tokamax's result, our reference's result) of a case, on the
  host: computed once per process (shared by every implementation's tests,
  which on the chip run side by side: the first computes it), or taken from
  the oracle source."""
  def compute():
    given = _SOURCE(case_id) if _SOURCE is not None else None
    return given if given is not None else compute_expected(lay)
  return _EXPECTED.get(case_id, compute)


def set_oracle_source(source) -> None:
  """`source(case_id)`: the case's `expected` tuple computed elsewhere (the
  on-chip tier's child processes, tests/tpu/oracles.py), or None to compute
  it here. `set_oracle_source(None)`: always here."""
  global _SOURCE
  _SOURCE = source


def forget(case_id) -> None:
  """Drops a case's inputs and oracles (once every test of it has run)."""
  _EXPECTED.forget(case_id)


def compute_expected(lay):
  """A layout's fresh inputs and both oracles' results on them, on the host."""
  args, kwargs = make(lay)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in STATIC}
  tokamax_fn = tokamax_oracle(lay)
  theirs = jax.jit(lambda a, kw: tokamax_fn(a, kw | static))(args, arrays)
  ours = jax.jit(lambda a, kw: api.causal_conv1d_gated_delta_rule(
      *a, **kw, **static, implementation="reference"))(args, arrays)
  return _host((args, kwargs)), _host(theirs), _host(ours)


def _host(tree):
  """`tree`'s arrays as numpy arrays: the checks index and compare them on the
  host (on a TPU every eager op on a new shape would be a compile of its own,
  and the tier checks many shapes), and the cases' inputs wait there for the
  tests that want them, not in the chip's memory."""
  return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, tree)


def make(lay, seed=0):
  """(args, kwargs) of a layout: positional arrays + optional + static keywords
  (drawn on the host: `tokamax_gdn.testing.draws`)."""
  return draws.draw(lambda key: arg_specs.random_call(key, lay), seed)


def written_slots(lay) -> set[int]:
  """Slots the layout's valid requests write (module doc of base.py)."""
  qsl, slots = lay["query_start_loc"], lay["state_indices"]
  n_dec, n_valid = int(lay["distribution"][0]), int(lay["distribution"][2])
  out = set()
  for r in range(n_valid):
    length = int(qsl[r + 1] - qsl[r])
    if length:
      out.update(range(slots[r], slots[r] + (length if r < n_dec else 1)))
  return out


def assert_close(actual, expected, dtype, what):
  err = rel_rms(actual, expected)
  tol = tolerance(dtype, grad=False)
  assert err <= tol, f"{what}: rel-RMS {err:.3g} > {tol:.3g}"


def tokamax_oracle(lay):
  """tokamax's oracle for a layout, fn(args, kwargs) to call under jit. Its
  local reference for plain batches; for verify windows its test module's
  token-by-token `gdn_attention_spec_ref`, which loops in Python over the
  requests' concrete indices: those are the layout's own (numpy), so under
  jit it is one program (called eagerly on a chip, each of its thousands of
  steps on a new slice was a compile of its own)."""
  if not lay.get("num_spec_tokens"):
    def plain(args, kwargs):
      kwargs = {k: v for k, v in kwargs.items() if k != "num_spec_tokens"}
      return tokamax_reference.run_jax_gdn_attention_local_ref(*_fresh_conv_zeroed(args),
                                                                 **kwargs)
    return plain

  def windows(args, kwargs):
    names = arg_specs.POSITIONAL
    full = dict(zip(names, args)) | kwargs
    concrete = ("query_start_loc", "state_indices", "read_offsets", "seq_lens")
    return tokamax_tests.gdn_attention_spec_ref(
        **{n: full[n] for n in names[:9]}, **{n: np.asarray(lay[n]) for n in concrete},
        num_spec_seqs=int(lay["distribution"][0]),
        **{n: full[n] for n in STATIC if n != "num_spec_tokens"})
  return windows


def _fresh_conv_zeroed(args):
  """args with the conv slots of fresh requests zeroed in a decode-only batch.

  tokamax's jitted reference departs from its kernel and oracles there: its
  decode-only branch (decode_end = mixed_end) reads the conv slot of a fresh
  request (seq_lens <= its tokens) as if it had context. With that slot zero
  it computes what a fresh request is (the slot is written, never read, so
  ours see the pools as drawn). At tokamax's tp8_decode_* workloads (fresh
  one-token decodes, random pools) the unadjusted oracle is ~100 % off."""
  args = list(args)
  qsl, slots, dist, seq_lens = args[9:13]
  n = slots.shape[0]
  tokens = qsl[1:n + 1] - qsl[:n]
  fresh = (jnp.arange(n) < dist[2]) & (seq_lens <= tokens) & (dist[0] == dist[2])
  conv = args[3]
  args[3] = conv.at[jnp.where(fresh, slots, conv.shape[0])].set(0, mode="drop")
  return tuple(args)


@contextlib.contextmanager
def traced_or_compiled_here():
  """The jax functions traced or compiled in this thread inside the block (a
  list, filled as it runs). Other threads' (the on-chip tier runs tests side
  by side, calling the same jitted functions) are not counted."""
  me, seen = threading.get_ident(), []

  def listen(event, seconds, **kwargs):
    del seconds
    if event in (dispatch.JAXPR_TRACE_EVENT, dispatch.BACKEND_COMPILE_EVENT) and (
        threading.get_ident() == me):
      seen.append(kwargs.get("fun_name", event))

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def _bits(x):
  x = np.asarray(x)
  return x.view(np.uint16 if x.dtype.itemsize == 2 else np.uint32)


class ServingTestBase:
  """Subclasses set IMPL and may override `context`."""

  IMPL = "reference"
  # Head counts and sizes of the property tests' layouts (on a chip the
  # Pallas kernels pad heads to multiples of 128 lanes).
  DIMS = TINY
  # The reference is the oracle of the property tests below; its own test
  # checks it against tokamax only.
  PROPERTIES = True

  def context(self):
    return contextlib.nullcontext()

  def call(self, args, kwargs, impl=None):
    """The op (`impl`, default IMPL) under jit (index arrays traced: one
    compile per shape and target TPU generation: the Pallas kernels take
    other forms per generation, and jit's cache does not see
    `config.set_target_chip`)."""
    impl = impl or self.IMPL
    static = {k: v for k, v in kwargs.items() if k in STATIC}
    arrays = {k: v for k, v in kwargs.items() if k not in STATIC}
    key = (impl, config.target_generation().name, tuple(sorted(static.items())))
    with _JITTED_LOCK:     # (the on-chip tier's tests call it from several threads)
      if key not in _JITTED:
        _JITTED[key] = jax.jit(lambda a, kw: api.causal_conv1d_gated_delta_rule(
            *a, **kw, **static, implementation=impl))
      fn = _JITTED[key]
    with self.context():
      return jax.block_until_ready(fn(args, arrays))

  def _check_against_ours_and_tokamax(self, case_id, lay):
    (args, kwargs), (t_pools, t_out), (r_pools, r_out) = expected(case_id, lay)
    (conv, rec), out = ((r_pools, r_out) if self.IMPL == "reference" else
                        _host(self.call(args, kwargs)))
    conv_in, rec_in = np.asarray(args[3]), np.asarray(args[4])
    dtype = lay["qkv"].dtype if lay["recurrent_state"].dtype == jnp.float32 else jnp.bfloat16
    n_tok = int(lay["query_start_loc"][int(lay["distribution"][2])])
    written = np.array(sorted(written_slots(lay)))
    assert_close(out[:n_tok], t_out[:n_tok], dtype, "out vs tokamax")
    assert_close(rec[written], t_pools[1][written], dtype, "recurrent vs tokamax")
    assert_close(conv[written], t_pools[0][written], dtype, "conv vs tokamax")
    np.testing.assert_array_equal(np.asarray(out[n_tok:], np.float32), 0.0)
    # Every other slot (the null slot 0 that padding requests name included)
    # is bit-identical.
    untouched = np.array(sorted(set(range(rec.shape[0])) - set(written.tolist())))
    np.testing.assert_array_equal(_bits(rec[untouched]), _bits(rec_in[untouched]))
    np.testing.assert_array_equal(_bits(conv[untouched]), _bits(conv_in[untouched]))
    assert_close(out, r_out, dtype, "out vs reference")
    assert_close(rec, r_pools[1], dtype, "recurrent vs reference")
    assert_close(conv, r_pools[0], dtype, "conv vs reference")

  @pytest.mark.parametrize("case_id,lay", CASES, ids=[c[0] for c in CASES])
  def test_against_tokamax_reference(self, case_id, lay):
    lay = arg_specs.layout(**lay)
    self._check_against_ours_and_tokamax(case_id, lay)

  @pytest.mark.parametrize("case_id,lay", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
  def test_spec_windows_against_tokamax(self, case_id, lay):
    lay = arg_specs.layout(**lay)
    self._check_against_ours_and_tokamax(case_id, lay)

  def test_window_checkpoints_are_single_token_decodes(self):
    """Checkpoint j of a 3-token window = the state after j + 1 one-token
    calls, of the reference (the window is the implementation's: a second
    program of the implementation would double its interpret-mode compile)."""
    if not self.PROPERTIES:
      pytest.skip("property tests run for the implementations, not the oracle")
    lay = arg_specs.layout(lengths=[3], context_lens=5, num_spec_tokens=2, **self.DIMS, **F32)
    args, kwargs = make(lay, seed=3)
    kwargs["read_offsets"] = jnp.array([1], jnp.int32)
    (conv, rec), out = self.call(args, kwargs)
    one = arg_specs.layout(lengths=[1], context_lens=5, **self.DIMS, **F32)
    pools = (args[3].at[1].set(args[3][2]), args[4].at[1].set(args[4][2]))   # read slot 1 + 1
    for j in range(3):
      step_args = (args[0][j:j + 1], args[1][j:j + 1], args[2][j:j + 1], *pools, *args[5:9],
                   jnp.asarray(one["query_start_loc"]), jnp.asarray(one["state_indices"]),
                   jnp.asarray(one["distribution"]), jnp.asarray(one["seq_lens"]))
      pools, o = self.call(step_args, {n: one[n] for n in STATIC if n in one},
                           impl="reference")
      assert_close(out[j], o[0], jnp.float32, f"out {j}")
      assert_close(rec[1 + j], pools[1][1], jnp.float32, f"recurrent checkpoint {j}")
      assert_close(conv[1 + j], pools[0][1], jnp.float32, f"conv checkpoint {j}")

  def test_continuation_equals_one_call(self):
    """A prefill split in two calls (the second with seq_lens > its tokens)
    gives the one-call outputs and final states. Each part is padded to the
    whole call's tokens (rows past the last valid request are padding): one
    compile for the three calls."""
    if not self.PROPERTIES:
      pytest.skip("property tests run for the implementations, not the oracle")
    lay = arg_specs.layout(lengths=[26], **self.DIMS, **F32)
    args, kwargs = make(lay, seed=5)
    (conv, rec), out = self.call(args, kwargs)
    pools = args[3:5]
    outs = []
    for lo, hi in ((0, 13), (13, 26)):
      # The part's tokens first, then the other half's as padding rows.
      rows = np.r_[lo:hi, 0:lo, hi:26]
      part = (args[0][rows], args[1][rows], args[2][rows], *pools, *args[5:9],
              jnp.array([0, hi - lo], jnp.int32), args[10], args[11],
              jnp.array([hi], jnp.int32))
      pools, o = self.call(part, kwargs)
      np.testing.assert_array_equal(np.asarray(o[hi - lo:], np.float32), 0.0)
      outs.append(o[:hi - lo])
    assert_close(jnp.concatenate(outs), out, jnp.float32, "out")
    assert_close(pools[1][1], rec[1], jnp.float32, "recurrent")
    assert_close(pools[0][1], conv[1], jnp.float32, "conv")

  def test_nan_isolation(self):
    """A NaN in one request's tokens, or in the slot it reads, reaches no
    other request's outputs or slots (bit for bit), and does reach its own."""
    if not self.PROPERTIES:
      pytest.skip("property tests run for the implementations, not the oracle")
    lay = arg_specs.layout(lengths=[1, 1, 1, 9, 14, 5], context_lens=[3, 3, 3, 0, 4, 0],
                           **self.DIMS, **F32)
    args, kwargs = make(lay, seed=7)
    clean = self.call(args, kwargs)
    qsl = lay["query_start_loc"]
    for victim, poison in ((1, "token"), (4, "token"), (4, "slot"), (2, "slot")):
      bad = list(args)
      lo, hi = int(qsl[victim]), int(qsl[victim + 1])
      if poison == "token":
        bad[0] = bad[0].at[lo + (hi - lo) // 2, 3].set(jnp.nan)
      else:
        slot = int(lay["state_indices"][victim])
        bad[4] = bad[4].at[slot].set(jnp.nan)
      (conv, rec), out = self.call(tuple(bad), kwargs)
      keep = np.ones(out.shape[0], bool)
      keep[lo:hi] = False
      np.testing.assert_array_equal(np.asarray(out)[keep], np.asarray(clean[1])[keep])
      assert np.isnan(np.asarray(out)[lo:hi]).any(), (victim, poison)
      others = np.array([s for s in range(rec.shape[0])
                         if s != int(lay["state_indices"][victim])])
      np.testing.assert_array_equal(np.asarray(rec)[others], np.asarray(clean[0][1])[others])
      np.testing.assert_array_equal(np.asarray(conv)[others], np.asarray(clean[0][0])[others])

  def test_seq_lens_below_token_count_is_a_fresh_request(self):
    """tokamax's convention: a request whose seq_lens is at or below its token
    count starts from zeros, reading nothing (a NaN in its slot stays out)."""
    if not self.PROPERTIES:
      pytest.skip("property tests run for the implementations, not the oracle")
    lay = arg_specs.layout(lengths=[1, 9, 6], context_lens=[3, 0, 0], **self.DIMS, **F32)
    args, kwargs = make(lay, seed=13)
    fresh = self.call(args, kwargs)
    bad = list(args)
    bad[12] = args[12].at[1].set(2)                     # seq_lens 2 < 9 tokens
    bad[4] = args[4].at[int(lay["state_indices"][1])].set(jnp.nan)
    (conv, rec), out = self.call(tuple(bad), kwargs)
    np.testing.assert_array_equal(_bits(out), _bits(fresh[1]))
    np.testing.assert_array_equal(_bits(rec), _bits(fresh[0][1]))
    np.testing.assert_array_equal(_bits(conv), _bits(fresh[0][0]))

  @pytest.mark.parametrize("windows", [False, True], ids=["slots", "spec_windows"])
  def test_slots_outside_the_pool_under_jit(self, windows):
    """Under jit (no eager check of the indices) a request whose write slot,
    read slot or verify window lies outside the pool (past the end, negative,
    a window running past the end) reads and writes nothing and its output
    rows are NaN; every other row, and every slot but the one it would have
    written, is bit-identical to the call without it."""
    if not self.PROPERTIES:
      pytest.skip("property tests run for the implementations, not the oracle")
    if windows:
      lay = arg_specs.layout(lengths=[4, 3, 1, 2], context_lens=9, num_spec_tokens=3,
                             max_reqs=5, **self.DIMS)
    else:
      lay = arg_specs.layout(lengths=[1, 1, 1, 9, 14, 5], context_lens=[3, 3, 3, 0, 4, 0],
                             **self.DIMS, **F32)
    args, kwargs = make(lay, seed=11)
    (c_conv, c_rec), c_out = self.call(args, kwargs)
    n_slots = args[4].shape[0]
    qsl = lay["query_start_loc"]
    slots = np.asarray(args[10])
    window = lay.get("num_spec_tokens", 0) + 1
    cases = ([(0, n_slots - 2), (1, -1)] if windows
             else [(1, n_slots + 3), (4, -1), (2, -5), (4, n_slots)])
    for victim, slot in cases:
      bad = list(args)
      bad[10] = jnp.asarray(np.where(np.arange(slots.size) == victim, slot, slots), jnp.int32)
      (conv, rec), out = self.call(tuple(bad), kwargs)
      lo, hi = int(qsl[victim]), int(qsl[victim + 1])
      out, c_out_np = np.asarray(out, np.float32), np.asarray(c_out, np.float32)
      assert np.isnan(out[lo:hi]).all(), (victim, slot)
      keep = np.ones(out.shape[0], bool)
      keep[lo:hi] = False
      np.testing.assert_array_equal(_bits(out[keep]), _bits(c_out_np[keep]))
      own = set(range(slots[victim], slots[victim] + window))
      others = np.array([s for s in range(n_slots) if s not in own])
      np.testing.assert_array_equal(_bits(rec[others]), _bits(c_rec[others]))
      np.testing.assert_array_equal(_bits(conv[others]), _bits(c_conv[others]))
      mine = np.array(sorted(own & set(range(n_slots))))
      np.testing.assert_array_equal(_bits(rec[mine]), _bits(args[4][mine]))

  def test_composition_change_does_not_recompile(self):
    """Same T and R as test_nan_isolation's batch, another composition (one
    prefill, padding requests): no new compile."""
    if not self.PROPERTIES:
      pytest.skip("property tests run for the implementations, not the oracle")
    first = arg_specs.layout(lengths=[1, 1, 1, 9, 14, 5], context_lens=[3, 3, 3, 0, 4, 0],
                             **self.DIMS, **F32)
    other = arg_specs.layout(lengths=[31], max_reqs=6, **self.DIMS, **F32)
    self.call(*make(first))
    args, kwargs = make(other)
    with traced_or_compiled_here() as programs:
      self.call(args, kwargs)
    assert not programs, f"traced or compiled again: {programs}"

  @pytest.mark.parametrize("change,argname", [
      (dict(query_start_loc=[0, 2, 1, 12]), "query_start_loc"),       # decreasing
      (dict(query_start_loc=[0, 1, 2, 13]), "query_start_loc"),       # past T
      (dict(query_start_loc=[0, 2, 3, 12]), "query_start_loc"),       # decode of 2 tokens
      (dict(state_indices=[1, 1, 3]), "state_indices"),               # same slot twice
      (dict(state_indices=[1, 2, 4]), "state_indices"),               # outside the pool
      (dict(read_offsets=[0, 3, 0]), "read_offsets"),                 # read outside the pool
      (dict(distribution=[2, 1, 3]), "distribution"),                 # decreasing
  ], ids=["qsl_decreasing", "qsl_past_tokens", "decode_too_long", "duplicate_slot",
          "slot_outside_pool", "read_outside_pool", "distribution_decreasing"])
  def test_bad_concrete_metadata_is_a_clear_error(self, change, argname):
    lay = arg_specs.layout(lengths=[1, 1, 10], context_lens=[2, 2, 0], **self.DIMS, **F32)
    args, kwargs = make(lay)
    names = arg_specs.POSITIONAL
    full = dict(zip(names, args)) | kwargs
    full.update({k: jnp.asarray(v, jnp.int32) for k, v in change.items()})
    with pytest.raises(ValueError, match=argname):
      with self.context():
        api.causal_conv1d_gated_delta_rule(**full, implementation=self.IMPL)

  def test_list_index_array_is_a_clear_error(self):
    """A Python list where an array goes names the argument (no AttributeError)."""
    lay = arg_specs.layout(lengths=[1, 1, 10], context_lens=[2, 2, 0], **self.DIMS, **F32)
    args, kwargs = make(lay)
    full = dict(zip(arg_specs.POSITIONAL, args)) | kwargs
    full["query_start_loc"] = [0, 1, 2, 12]
    with pytest.raises(TypeError, match="query_start_loc"):
      with self.context():
        api.causal_conv1d_gated_delta_rule(**full, implementation=self.IMPL)
