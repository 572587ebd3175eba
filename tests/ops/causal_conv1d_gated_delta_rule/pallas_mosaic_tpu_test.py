"""The pallas_mosaic_tpu serving op: the shared checks (test_base) in Pallas
interpret mode, the routing between its decode kernel and chunked path, and
AOT compiles for v5e / v6e / tpu7x at a realistic decode shape whose kernels
the static cycle estimator must accept."""

import contextlib
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tokamax_gdn
from tokamax_gdn import aot
from tokamax_gdn import config
from tokamax_gdn.aot import serving as aot_serving
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_vmem as gdn_vmem

from . import test_base  # pylint: disable=relative-beyond-top-level
from .test_base import CASES, F32, SPEC_CASES, STATIC, TINY, ServingTestBase, assert_close, make  # pylint: disable=relative-beyond-top-level

IMPL = "pallas_mosaic_tpu"
# Interpret mode runs these kernels at ~1 min per case on the shared CPUs:
# the cases below cover decode + prefill + padded + context (f32 pools),
# GVA 1:4 (bf16 pools), d_k = d_v = 128, verify windows (bf16, padded); the
# others of test_base are left to the xla implementation's run.
_KEEP = ("mixed_padded_ctx", "gva_1to4_bf16_pools", "dk128_f32_act_bf16_pools")
_KEEP_SPEC = ("spec3_padded_bf16",)
class TestPallasMosaicTpu(ServingTestBase):
  IMPL = IMPL

  def context(self):
    return config.interpret_mode()

  @pytest.mark.parametrize("case_id,lay", [c for c in CASES if c[0] in _KEEP], ids=_KEEP)
  def test_against_tokamax_reference(self, case_id, lay):
    super().test_against_tokamax_reference(case_id, lay)

  @pytest.mark.parametrize("case_id,lay", [c for c in SPEC_CASES if c[0] in _KEEP_SPEC],
                           ids=_KEEP_SPEC)
  def test_spec_windows_against_tokamax(self, case_id, lay):
    super().test_spec_windows_against_tokamax(case_id, lay)


def _assert_matches_reference(args, static, conv, rec, out, arrays=None):
  """The op's results (f32) against the reference implementation's (jitted);
  `arrays`: the call's optional index arrays (read_offsets, ...)."""
  (r_conv, r_rec), r_out = jax.jit(lambda a, kw: tokamax_gdn.causal_conv1d_gated_delta_rule(
      *a, **kw, **static, implementation="reference"))(args, arrays or {})
  assert_close(out, r_out, jnp.float32, "out")
  assert_close(rec, r_rec, jnp.float32, "recurrent")
  assert_close(conv, r_conv, jnp.float32, "conv")


def test_v5e_forms_against_tokamax_reference():
  """Traced for v5e the decode kernel takes other forms of its bf16 pool
  products (`DecodeStatic.v5e_forms`): same contract (bf16 pools, GVA 1:4)."""
  (case,) = [c for c in CASES if c[0] == "gva_1to4_bf16_pools"]
  config.set_target_chip("v5e")
  try:
    TestPallasMosaicTpu().test_against_tokamax_reference(*case)
  finally:
    config.set_target_chip(None)


@pytest.mark.parametrize("lengths,context,chunked,min_chunked", [
    ([1, 1, 70, 5], [3, 0, 4, 2], [2], 64),                   # T // 64 = 1: N = 1
    ([1, 1, 70, 3, 20, 17], [3, 0, 4, 2, 5, 0], [2, 4, 5], 16),  # N = 3, one block shared
], ids=["one", "three"])
def test_chunked_requests_after_decodes(lengths, context, chunked, min_chunked):
  """One batch through both paths: chunked requests (`min_chunked_tokens`
  and more) that start after decodes and continue their slots, with a short
  prefill among them (the decode kernel, token by token past its window):
  the conv with its SiLU and no segment ids (each request's first W-1 rows
  redone from its conv state); for N = 1 q, k, v read packed by the GDN
  kernel; for N = 3 a request of two chunks (the second partial) and two
  shorter than a chunk, all three in its second block. Against the
  reference; a NaN in the tokens of a neighbour (inside a request's first
  conv window) or in a slot a neighbour reads stays out of the chunked
  requests, and one in a chunked request's read slot out of every other
  request (chunked ones included)."""
  lay = arg_specs.layout(lengths=lengths, context_lens=context, max_reqs=6, **TINY, **F32)
  args, kwargs = make(lay, seed=13)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  cfg = pallas_mosaic_tpu.Config(decode_tile=8, chunk_size=64, min_chunked_tokens=min_chunked)
  op = jax.jit(lambda *a: pallas_mosaic_tpu.IMPLEMENTATION.replace(config=cfg)(*a, **static))
  with config.interpret_mode():
    (conv, rec), out = op(*args)
  _assert_matches_reference(args, static, conv, rec, out)

  qsl, slots = lay["query_start_loc"], lay["state_indices"]
  mine = np.zeros(out.shape[0], bool)
  for r in chunked:
    mine[qsl[r]:qsl[r + 1]] = True
  ours = np.isin(np.arange(rec.shape[0]), slots[chunked])
  first = chunked[0]
  for poison in ("token_before", "token_after", "neighbour_slot", "own_slot"):
    bad = list(args)
    if poison == "token_before":      # the decode right before the first chunked request
      bad[0] = bad[0].at[qsl[first] - 1].set(jnp.nan)
    elif poison == "token_after":     # the short prefill right after it
      bad[0] = bad[0].at[qsl[first + 1]].set(jnp.nan)
    else:
      bad[4] = bad[4].at[slots[first] if poison == "own_slot" else slots[0]].set(jnp.nan)
    with config.interpret_mode():
      (b_conv, b_rec), b_out = op(*bad)
    rows, keep = mine, ours
    if poison == "own_slot":          # everything but the first chunked request's
      rows = np.ones_like(mine)
      rows[qsl[first]:qsl[first + 1]] = False
      keep = np.arange(rec.shape[0]) != slots[first]
    np.testing.assert_array_equal(np.asarray(b_out)[rows], np.asarray(out)[rows], poison)
    np.testing.assert_array_equal(np.asarray(b_rec)[keep], np.asarray(rec)[keep], poison)
    np.testing.assert_array_equal(np.asarray(b_conv)[keep], np.asarray(conv)[keep], poison)
    if poison == "own_slot":
      assert np.isnan(np.asarray(b_out)[qsl[first]:qsl[first + 1]]).any()


def test_chunked_path_with_token_arrays_in_hbm(monkeypatch):
  """Long calls keep the chunked path's token arrays in HBM (the conv's x
  and y at 512-token tiles, `gdn_fwd_requests`' qkv; `_HBM_TOKEN_BYTES`):
  the same results, here forced on a small call with two chunked requests."""
  monkeypatch.setattr(pallas_mosaic_tpu, "_HBM_TOKEN_BYTES", 0)
  lay = arg_specs.layout(lengths=[1, 70, 3, 66], context_lens=[3, 4, 2, 0], **TINY, **F32)
  args, kwargs = make(lay, seed=17)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  cfg = pallas_mosaic_tpu.Config(decode_tile=8, chunk_size=64, min_chunked_tokens=64)
  op = jax.jit(lambda *a: pallas_mosaic_tpu.IMPLEMENTATION.replace(config=cfg)(*a, **static))
  with config.interpret_mode():
    assert "memory_space_constraint" in str(jax.make_jaxpr(op)(*args))
    (conv, rec), out = op(*args)
  _assert_matches_reference(args, static, conv, rec, out)


@pytest.mark.parametrize("resident", [True, False], ids=["resident_out", "two_outputs"])
def test_fresh_groups_and_zeroed_rows(resident, monkeypatch):
  """Groups of requests that all start from zeros take the kernel's
  state-free steps (group 0 here, with a fresh short prefill whose tokens
  push the later requests' tokens off their rows), a group with one
  continuing request the full ones (both groups in one tile of 16); rows of
  padding tokens are zero. With the output resident in VMEM and, as for
  large T, as two outputs summed (one tile of 8 requests there: interpret
  mode compiles a tile of 16 twice as long, and the groups are the first
  case's)."""
  if resident:
    lay = arg_specs.layout(lengths=[1, 1, 1, 6] + [1] * 8,
                           context_lens=[0] * 9 + [2, 0, 0], max_reqs=14, **TINY, **F32)
    tile = 16
  else:
    monkeypatch.setattr(pallas_mosaic_tpu, "_RESIDENT_OUT_BYTES", 0)
    lay = arg_specs.layout(lengths=[1, 1, 1, 6] + [1] * 4,
                           context_lens=[0] * 5 + [2, 0, 0], max_reqs=8, **TINY, **F32)
    tile = 8
  args, kwargs = make(lay, seed=5)
  args = list(args)
  # Two padding tokens past the valid ones (rows that no request owns).
  for i in range(3):
    args[i] = jnp.concatenate([args[i], jnp.full((2, args[i].shape[1]), 7.0, args[i].dtype)])
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  cfg = pallas_mosaic_tpu.Config(decode_tile=tile, chunk_size=64, min_chunked_tokens=128)
  impl = pallas_mosaic_tpu.IMPLEMENTATION.replace(config=cfg)
  with config.interpret_mode():   # jitted: one compile, not op-by-op dispatch
    (conv, rec), out = jax.jit(lambda a: impl(*a, **static))(tuple(args))
  _assert_matches_reference(tuple(args), static, conv, rec, out)
  np.testing.assert_array_equal(np.asarray(out)[-2:], 0)


# ---------------------------------------------------------------- AOT
_AOT_SPEC = "tp8_decode_64"     # tokamax's qwen3_5_397b TP8 decode: Hv=8, K=V=128, bf16


def _aot_case(mesh, label, lay, full=False, chunk_cost=None):
  """An `aot.compile_in_child` case: the op at a layout (`arg_specs.layout`'s
  keys: abstract arrays, concrete index arrays, sizes), index arrays traced
  (as an engine passes them); `full`: the decode kernel's cost model,
  `chunk_cost` (a bool) the chunked kernel's (`pallas_mosaic_tpu.full_chunk_cost`)."""
  import contextlib  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api  # pylint: disable=g-import-not-at-top

  names = [n for n in arg_specs.POSITIONAL if n in lay]
  abstract = [aot.spec(mesh, lay[n].shape,
                       jnp.int32 if isinstance(lay[n], np.ndarray) else lay[n].dtype)
              for n in names]
  static = {k: lay[k] for k in STATIC if k in lay}

  def fn(*xs):
    kw = dict(zip(names, xs))
    pos = [kw.pop(n) for n in arg_specs.POSITIONAL[:13]]
    ctx = contextlib.ExitStack()
    if full:
      ctx.enter_context(pallas_mosaic_tpu.full_decode_cost())
    if chunk_cost is not None:
      ctx.enter_context(pallas_mosaic_tpu.full_chunk_cost(chunk_cost))
    with ctx:
      return api.causal_conv1d_gated_delta_rule(*pos, **kw, **static, implementation=IMPL)

  return (label, fn, abstract)


def aot_cases(mesh, full=False, spec_name=_AOT_SPEC, chunk_cost=None):
  """`aot.compile_in_child` builder: the op at one of tokamax's qwen3_5_397b
  layouts (default tp8_decode_64); `full`, `chunk_cost`: as `_aot_case`'s."""
  from tokamax._src.ops.causal_conv1d_gated_delta_rule import arg_specs as tokamax_specs  # pylint: disable=g-import-not-at-top

  spec = next(s for s in tokamax_specs.ARG_SPECS
              if s.project == "qwen3_5_397b" and s.name == spec_name).args
  return [_aot_case(mesh, f"{spec_name} full={full}", spec, full, chunk_cost)]


def aot_layout_cases(mesh, layouts):
  """`aot.compile_in_child` builder: the op at `arg_specs.layout(**kw)` for
  each kw of `layouts` (dtypes by name: the child gets them as JSON)."""
  return [_aot_case(mesh, f"layout {i}",
                    arg_specs.layout(**{k: jnp.dtype(v) if k.endswith("dtype") else v
                                        for k, v in kw.items()}))
          for i, kw in enumerate(layouts)]


def aot_cases_of(mesh, spec_names):
  """`aot_cases` of several of tokamax's layouts."""
  return [case for name in spec_names for case in aot_cases(mesh, spec_name=name)]


def _compile_here(target, builder, **kwargs):
  """What `aot.compile_in_child(target, builder, kwargs, cycles=False)` returns,
  compiled in this process: an `aot` test runs in a child process of its own
  already (tests/conftest.py), and a second one cost a start of Python, jax
  and libtpu. (Cycle estimates need libtpu started with the dump: a child.)"""
  mesh = aot.target_mesh(target)
  return list(aot.compile_cases(target, builder(mesh, **kwargs), mesh))


def test_window_checkpoint_buffers_stay_in_range():
  """Every token of an interleaved window writes a checkpoint buffer
  (`window_checkpoint`): always one of the request's `window` buffers, and
  exactly slot t - (length - checkpoints) for the tokens whose state a DMA
  writes back. Out of range it would land in another request's buffers
  (interpret mode clamps such indices, the chip does not check them)."""
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu_decode_static as dec  # pylint: disable=g-import-not-at-top
  for window in (2, 4, 8):
    # (length, checkpoints) as the kernel's metadata has them: decodes
    # (min(length, window)), short prefills (1), requests that do not run
    # here (length 0; 1 checkpoint where valid, e.g. a chunked-path request).
    metas = ([(n, min(n, window)) for n in range(1, window + 1)]
             + [(n, 1) for n in range(1, 3 * window)] + [(0, 0), (0, 1)])
    for length, ckpts in metas:
      for t in range(window):
        c = int(dec.window_checkpoint(t, length, ckpts, window))
        assert 0 <= c < window, (window, length, ckpts, t, c)
        if t < length and t - (length - ckpts) >= 0:
          assert c == t - (length - ckpts), (window, length, ckpts, t, c)


def test_window_nan_stays_causal_and_in_its_request():
  """A verify window runs its tokens at once (`pallas_mosaic_tpu_decode_step.Window`):
  a NaN in token 2 of one request's window reaches neither the other
  requests' rows and slots nor its own earlier tokens' rows and checkpoints
  (bit for bit), as in a token-by-token scan; its later ones are NaN. The
  request after it is shorter than the window, so the rows past its length
  (gathered from the next tokens) hold tokens of other requests."""
  lay = arg_specs.layout(lengths=[4, 3, 4, 2, 4], context_lens=[5, 0, 6, 7, 2],
                         num_spec_tokens=3, **TINY, **F32)
  args, kwargs = make(lay, seed=31)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in STATIC}
  op = jax.jit(lambda a, kw: pallas_mosaic_tpu.IMPLEMENTATION(*a, **kw, **static))
  with config.interpret_mode():
    (conv, rec), out = op(tuple(args), arrays)
    _assert_matches_reference(tuple(args), static, conv, rec, out, arrays)
    victim, token = 2, 2
    qsl, slots = lay["query_start_loc"], lay["state_indices"]
    bad = list(args)
    bad[0] = bad[0].at[int(qsl[victim]) + token, 16 + 3].set(jnp.nan)   # a key channel (TINY)
    (b_conv, b_rec), b_out = op(tuple(bad), arrays)
  keep = np.ones(out.shape[0], bool)
  keep[int(qsl[victim]) + token:int(qsl[victim + 1])] = False
  np.testing.assert_array_equal(np.asarray(b_out)[keep], np.asarray(out)[keep])
  assert np.isnan(np.asarray(b_out)[~keep]).all(axis=1).any()
  mine = set(range(int(slots[victim]) + token, int(slots[victim]) + 4))
  others = [i for i in range(rec.shape[0]) if i not in mine]
  np.testing.assert_array_equal(np.asarray(b_rec)[others], np.asarray(rec)[others])
  np.testing.assert_array_equal(np.asarray(b_conv)[others], np.asarray(conv)[others])
  assert np.isnan(np.asarray(b_rec)[sorted(mine)]).all()


def test_window_keys_shorter_than_a_slab():
  """d_k under the 16 state rows a window's checkpoints are built in
  (`pallas_mosaic_tpu_decode_step._SLAB`; interpret mode runs heads unpadded),
  GVA 1:2, windows of 3, against the reference."""
  lay = arg_specs.layout(lengths=[3, 1, 2], context_lens=[4, 6, 0], num_spec_tokens=2,
                         n_kq=1, n_v=2, d_k=8, d_v=16, **F32)
  args, kwargs = make(lay, seed=37)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in STATIC}
  with config.interpret_mode():
    (conv, rec), out = jax.jit(lambda a, kw: pallas_mosaic_tpu.IMPLEMENTATION(
        *a, **kw, **static))(tuple(args), arrays)
  _assert_matches_reference(tuple(args), static, conv, rec, out, arrays)


# Heads of d_k, d_v below 128 lanes: GVA 1:4, decodes beside a prefill long
# enough for the chunked path, verify windows.
_SHORT_HEADS = [
    dict(lengths=[1, 1, 1, 150], context_lens=[3, 3, 0, 2], n_kq=1, n_v=4, d_k=32, d_v=16),
    dict(lengths=[4, 2, 1], context_lens=9, num_spec_tokens=3, n_kq=1, n_v=2, d_k=16, d_v=64,
         dtype="float32", state_dtype="float32"),
]


def aot_v5e_cases(mesh, spec_names, layouts):
  """`aot_cases_of` the specs, then `aot_layout_cases` of the layouts: the
  v5e compiles below."""
  return aot_cases_of(mesh, spec_names) + aot_layout_cases(mesh, layouts)


# tokamax's layouts compiled for v5e, and the kernel each must call. (The
# decodes and verify windows at DP8's 64 value heads, dp8_ep8_decode_64 and
# dp8_ep8_spec3_decode_*, and dp8_ep8_prefill_512, whose decode kernel once
# needed 55.1 MiB of scoped VMEM, were compiled here too; they run on the
# chip in the on-chip tier's named workloads, and CI's time went to them.)
_V5E_SPECS = {
    # One chunked request whose qkv is past `_HBM_TOKEN_BYTES`: the chunked GDN
    # kernel pipelines its blocks from HBM and Mosaic allocates 41.1 MiB for it
    # on v5e. The training forward's VMEM model, which the op used for it,
    # estimated 29.7 and the limit it set (37.2 MiB) failed on the chip and in
    # this compile alike (a 512-token prefill keeps its arrays where XLA puts
    # them, 28.8 MiB).
    "dp8_ep8_prefill_1024": "gdn_fwd_requests",
    # TP8 verify windows: two requests' windows interleaved (`state_slots`).
    "tp8_spec3_decode_64_ctx1024": "gdn_serve_decode",
    # (64 requests padded to 512, the kernel's dynamic grid and idle skip:
    # `test_pools_in_the_programs_layouts_are_not_copied_on_v5e` compiles
    # that call as it runs, where `aot_serving.cases` takes the cost model.)
}


@pytest.mark.aot
def test_serving_compiles_for_v5e():
  """The layouts above, and heads whose d_k or d_v is not a multiple of 128
  (run padded to 128 lanes on a chip, `pallas_mosaic_tpu._lane_dims`)
  through both paths, compile for v5e."""
  res = _compile_here("v5e", aot_v5e_cases, spec_names=list(_V5E_SPECS), layouts=_SHORT_HEADS)
  assert [r.error for r in res] == [None] * (len(_V5E_SPECS) + len(_SHORT_HEADS)), (
      [r.error for r in res])
  kernels = [*_V5E_SPECS.values(), "gdn_fwd_requests", "gdn_serve_decode"]
  for r, kernel in zip(res, kernels):
    if kernel is not None:
      assert r.report.pallas_calls.get(kernel) == 1, (r.label, r.report.pallas_calls)


@pytest.mark.aot
def test_pools_in_the_programs_layouts_are_not_copied_on_v5e():
  """With the pools' layouts left to XLA (`Layout.AUTO`, as the serving bench
  and an engine that allocates its pools for its compiled step place them),
  the padded decode's program copies neither pool; at the runtime's default
  layout it relays the whole conv pool out into the kernel and back (on the
  chip two copies, as long as the kernel, for a 513-slot pool)."""
  from tokamax_gdn.benchmarks import serving  # pylint: disable=g-import-not-at-top
  name = "tp8_padded_decode_64_max512"
  mesh = aot.target_mesh("v5e")
  args, arrays, _ = aot_serving._abstract(arg_specs.by_name(name), mesh)  # pylint: disable=protected-access
  _, kwargs = arg_specs.by_name(name).abstract()
  rest = args[:3] + args[5:]
  conv = "bf16[%s]" % ",".join(map(str, args[3].shape))
  copies = {}
  for layout in serving.POOL_LAYOUTS:
    with aot.on_target(mesh):
      hlo = serving.jitted_step("pallas_mosaic_tpu", kwargs, layout).lower(
          args[3], args[4], rest, arrays).compile().as_text()
    assert aot.pallas_calls(hlo).get("gdn_serve_decode") == 1, aot.pallas_calls(hlo)
    copies[layout] = aot.copies(hlo, conv)
  assert copies["auto"] == [], copies["auto"]
  assert len(copies["default"]) == 2, copies["default"]


@pytest.mark.parametrize("case", ["gva_1to4_bf16_pools", "chunked"])
def test_short_heads_padded_to_lanes(case, monkeypatch):
  """The padded path a chip takes for heads of d_k, d_v below 128 lanes,
  forced here in interpret mode: the decode kernel against tokamax and the
  reference, unused slots bit-identical (the shared check), and the chunked
  path beside decodes (the padding is the same around either path). A pad of anything but zeros, or the query scale taken from the
  padded d_k, fails these."""
  monkeypatch.setattr(pallas_mosaic_tpu, "_PAD_OFF_CHIP", True)
  monkeypatch.setattr(test_base, "_JITTED", {})      # no program traced unpadded
  pads = []
  pad = pallas_mosaic_tpu._pad_channels  # pylint: disable=protected-access
  monkeypatch.setattr(pallas_mosaic_tpu, "_pad_channels",
                      lambda *a, **k: pads.append(1) or pad(*a, **k))
  if case == "chunked":
    test_chunked_requests_after_decodes([1, 1, 70, 5], [3, 0, 4, 2], [2], 64)
  else:
    (spec,) = [c for c in CASES if c[0] == case]
    TestPallasMosaicTpu().test_against_tokamax_reference(*spec)
  assert pads


# Mosaic's scoped VMEM for `gdn_fwd_requests` on v5e, with its token arrays in
# HBM (the most it takes; v6e and tpu7x took less at every point), in MiB:
# (Hv, Hk, C, activation bytes, pool bytes) -> MiB. Measured by compiling it
# under limits just below each (Mosaic reports the allocation it failed).
_REQUESTS_VMEM_V5E = {
    (64, 16, 128, 2, 2): 41.08, (64, 16, 64, 2, 2): 24.51, (64, 16, 128, 2, 4): 43.08,
    (64, 16, 128, 4, 4): 65.41, (64, 16, 64, 4, 4): 36.19, (32, 8, 128, 2, 2): 20.54,
    (32, 8, 64, 2, 2): 11.76, (32, 8, 128, 4, 4): 32.76, (16, 2, 128, 2, 2): 9.90,
    (8, 2, 128, 2, 2): 5.73, (8, 2, 64, 2, 2): 3.20, (8, 2, 128, 4, 4): 8.20,
    (8, 2, 64, 4, 4): 4.62, (4, 2, 128, 2, 2): 3.39, (1, 1, 128, 2, 2): 1.21,
}


@pytest.mark.parametrize("key", list(_REQUESTS_VMEM_V5E), ids=str)
def test_requests_vmem_estimate_bounds_the_measured_allocation(key):
  """The chunked kernel's VMEM model is an upper bound of Mosaic's allocation
  (the op sets the limit from it: an estimate under it fails the compile),
  and not a loose one (within 30 % of it from 3 MiB on)."""
  hv, hk, chunk, itemsize, pool_itemsize = key
  need = gdn_vmem.requests_vmem_estimate(chunk=chunk, hv=hv, hk=hk, dim_k=128, dim_v=128,
                                         itemsize=itemsize, pool_itemsize=pool_itemsize)
  measured = _REQUESTS_VMEM_V5E[key] * 2**20
  assert need >= measured + (1 << 18), (need / 2**20, measured / 2**20)
  if measured > 3 * 2**20:
    assert need <= 1.3 * measured, (need / 2**20, measured / 2**20)


def _tokamax_workloads(gen):
  """(spec, bound arguments, heuristics' config, VMEM cap) of every tokamax
  workload in arg_specs.py with `gen` the target (set while the caller's
  loop body runs), as shapes: the heuristics read only shapes and static
  arguments."""
  import inspect  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api  # pylint: disable=g-import-not-at-top
  sig = inspect.signature(api.causal_conv1d_gated_delta_rule)
  for spec in arg_specs.ARG_SPECS:
    if "tokamax" not in spec.tags:
      continue
    static = {}

    def shapes(key, spec=spec, static=static):
      args, kwargs = spec.make(key)
      static.update({k: v for k, v in kwargs.items() if k in STATIC})
      return args, {k: v for k, v in kwargs.items() if k not in STATIC}

    args, kwargs = jax.eval_shape(shapes, jax.random.key(0))
    ba = sig.bind_partial(*args, **kwargs, **static)
    ba.apply_defaults()
    config.set_target_chip(gen)
    try:
      yield spec, ba, pallas_mosaic_tpu._heuristics(ba), pallas_mosaic_tpu._vmem_cap()  # pylint: disable=protected-access
    finally:
      config.set_target_chip(None)


@pytest.mark.parametrize("gen", ["v5e", "v6e", "tpu7x"])
def test_heuristic_chunk_fits_vmem_at_every_named_spec(gen):
  """At every tokamax workload the chunked kernel's estimate at the
  heuristics' chunk size is within the cap (so its limit, a quarter more up
  to what `check_vmem` accepts, is above what Mosaic allocates), and the
  TP8 workloads (8 value heads) keep C = 128. tpu7x: up to 16 value heads
  (its decode kernel refuses the 32- and 64-head workloads). 64 value heads
  with float32 activations take C = 64 on v5e / v6e (C = 128 estimates
  66.9 MiB)."""
  over = []
  for spec, ba, cfg, cap in _tokamax_workloads(gen):
    need = pallas_mosaic_tpu._chunk_vmem(ba.arguments, cfg.chunk_size)  # pylint: disable=protected-access
    if need > cap and (gen != "tpu7x" or ba.arguments["n_v"] <= 16):
      over.append((spec.name, cfg.chunk_size, need / 2**20))
    if ba.arguments["n_v"] <= 8:
      assert cfg.chunk_size == 128, spec.name
    if spec.name == "dp8_ep8_prefill_1024" and gen != "tpu7x":
      ba.arguments["qkv"] = jax.ShapeDtypeStruct(ba.arguments["qkv"].shape, jnp.float32)
      assert pallas_mosaic_tpu._heuristics(ba).chunk_size == 64  # pylint: disable=protected-access
  assert not over, f"over the cap: {over}"


@pytest.mark.aot
@pytest.mark.parametrize("target", ["v6e", "tpu7x"])
def test_decode_compiles_and_is_estimable(target):
  """Compiles for the chip, and libtpu's static estimate reports the decode
  kernel (the estimator aborts the process on kernels it cannot model). v5e:
  the next test."""
  (res,) = aot.compile_in_child(
      target, "tests.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_test:aot_cases",
      dict(full=True), timeout=600)
  assert res.report is not None, res.error
  cycles = {aot.kernel_name(k): v for k, v in res.report.kernel_cycles.items()}
  assert cycles.get("gdn_serve_decode", 0) > 0, cycles


@pytest.mark.aot
def test_cached_decode_compiles_and_is_estimable_on_v5e():
  """v5e: tp8_decode_cached_64_ctx8192 (every request reads its bf16 pool
  state, [q; k] S on the MXU) compiles and is estimated: the decode kernel
  takes the forms libtpu's estimator accepts there (`DecodeStatic.v5e_forms`;
  it aborted on an LLO type check before). The previous test's call is not
  estimable on v5e: libtpu's DMA latency model rejects one of its DMAs there
  ("Unsupported DMA direction: 10 on VL/VLP", an estimator limit that XLA's
  own gather / scatter fusions hit too)."""
  (res,) = aot.compile_in_child(
      "v5e", "tokamax_gdn.aot.serving:cases",
      dict(spec_name="tp8_decode_cached_64_ctx8192", implementation=IMPL), timeout=600)
  assert res.report is not None, res.error
  cycles = {aot.kernel_name(k): v for k, v in res.report.kernel_cycles.items()}
  assert cycles.get("gdn_serve_decode", 0) > 0, cycles


@pytest.mark.aot
@pytest.mark.parametrize("target", ["v5e", "tpu7x"])
def test_one_request_prefill_compiles(target):
  """tp8_prefill_1024 (one chunked request: the conv, `gdn_fwd_requests`, no
  XLA pass over the activations) compiles for the chip as it runs (block
  indices from SMEM: libtpu's estimator aborts on that kernel, see
  `gdn_fwd_requests`). v6e's forms of the kernel (unrolled head groups)
  compile in the next test, with static block indices instead (an own v6e
  compile here cost 18 CPU-s of the CI budget)."""
  (res,) = _compile_here(target, aot_cases, spec_name="tp8_prefill_1024")
  assert res.report is not None, res.error
  assert res.report.pallas_calls.get("gdn_fwd_requests") == 1, res.report.pallas_calls


@pytest.mark.aot
def test_one_request_prefill_is_estimable_on_v6e():
  """The same with the chunked kernel's cost model (static block indices,
  every item running): v6e's static estimate reports it."""
  (res,) = aot.compile_in_child(
      "v6e", "tests.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_test:aot_cases",
      dict(spec_name="tp8_prefill_1024", chunk_cost=True), cycles=True, timeout=600)
  assert res.report is not None, res.error
  cycles = {aot.kernel_name(k): v for k, v in res.report.kernel_cycles.items()}
  assert cycles.get("gdn_fwd_requests", 0) > 0, cycles


@pytest.mark.parametrize("tile,spec_tokens", [(2, 3), (4, 1)], ids=["tile2_window4", "tile4_window2"])
def test_small_tiles_for_windows(tile, spec_tokens):
  """Tiles under 8 requests (the heuristics' choice where 8 requests' states
  and checkpoints do not fit VMEM): tile x window = 8 token rows per block,
  padded requests and a fresh one among them, against the reference."""
  lay = arg_specs.layout(lengths=[spec_tokens + 1, 2, 1, spec_tokens + 1, 1],
                         context_lens=[9, 4, 0, 3, 6], num_spec_tokens=spec_tokens,
                         max_reqs=6, **TINY, **F32)
  args, kwargs = make(lay, seed=23)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in STATIC}
  cfg = pallas_mosaic_tpu.Config(decode_tile=tile, chunk_size=64, min_chunked_tokens=128)
  impl = pallas_mosaic_tpu.IMPLEMENTATION.replace(config=cfg)
  with config.interpret_mode():
    (conv, rec), out = jax.jit(lambda a, kw: impl(*a, **kw, **static))(tuple(args), arrays)
  _assert_matches_reference(tuple(args), static, conv, rec, out, arrays)


def test_decode_tile_must_make_whole_blocks():
  with pytest.raises(ValueError, match="multiple of 8"):
    pallas_mosaic_tpu.Config(decode_tile=3)
  assert pallas_mosaic_tpu._row_tile(1, 1) == 8  # pylint: disable=protected-access
  assert pallas_mosaic_tpu._row_tile(2, 4) == 2  # pylint: disable=protected-access
  assert pallas_mosaic_tpu._row_tile(2, 3) == 8  # pylint: disable=protected-access


@pytest.mark.parametrize("gen", ["v5e", "v6e"])
def test_heuristic_decode_tile_fits_vmem_at_every_named_spec(gen):
  """At every tokamax workload the heuristics' decode tile is within what the
  op accepts (`check_vmem`; on v5e a tile of 8 requests of 64 value heads
  with a verify window of 4 needed 104 MiB: the op refused the call)."""
  over = []
  for spec, ba, cfg, cap in _tokamax_workloads(gen):
    window = ba.arguments["num_spec_tokens"] + 1
    need = pallas_mosaic_tpu._decode_vmem(ba.arguments, cfg.decode_tile, window)  # pylint: disable=protected-access
    if need > gdn_vmem.accepted_need(cap):
      over.append((spec.name, cfg.decode_tile, need / 2**20))
  assert not over, f"over the cap: {over}"


def test_decode_kernel_under_the_race_detector(monkeypatch):
  """The decode kernel over several grid steps (one-token decodes, fresh and
  continuing, 128 lanes) in Pallas's TPU interpreter with its race detector
  on and uninitialised memory NaN: no DMA race, no read of memory nothing
  wrote, and the reference's results."""
  from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
  from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
  pallas_call, seen = pl.pallas_call, []

  def strict(*args, **kwargs):
    if kwargs.get("name") == "gdn_serve_decode" and kwargs.get("interpret") is True:
      kwargs["interpret"] = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan")
      seen.append(True)
    return pallas_call(*args, **kwargs)

  monkeypatch.setattr(pl, "pallas_call", strict)
  lay = arg_specs.layout(lengths=[1] * 20, context_lens=[0] * 10 + [4] * 10, max_reqs=24,
                         n_kq=1, n_v=2, d_k=128, d_v=128, **F32)
  args, kwargs = make(lay, seed=29)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  with config.interpret_mode():
    (conv, rec), out = jax.jit(lambda a: pallas_mosaic_tpu.IMPLEMENTATION(*a, **static))(
        tuple(args))
  assert seen, "the decode kernel did not run"
  _assert_matches_reference(tuple(args), static, conv, rec, out)


# Requests 0-2 decode, 3-31 have no tokens (a whole idle tile of 16, two of
# 8), 32-33 decode and 34 is a short prefill; 35-63 pad the batch, so that
# the skipping kernel's dynamic grid stops short of the padded tiles (3 of
# 4 tiles of 16, 5 of 8 tiles of 8).
_PADDED = dict(lengths=[1] * 3 + [0] * 29 + [1, 1, 4], context_lens=3, max_reqs=64)
SKIP_MODES = ("resident_out", "two_outputs", "unrolled_bf16_pools", "spec2_windows")


def padded_batch_programs(mode, dims=TINY, interpret=True):
  """The decode kernel on a padded batch (`_PADDED`, or its form for `mode`)
  with idle tiles and groups skipped and computed (`DecodeStatic.skip_idle`),
  traced and lowered: ((args, arrays, static), {skip: Lowered}). `dims`: the
  heads; `interpret`: Pallas interpret mode (else lowered for the device).

  Lowering is where the module switches `mode` sets take effect (it reads
  them while tracing), so the lowered programs can be compiled and run later,
  anywhere (the on-chip tier lowers these before it starts running tests side
  by side, which trace the same module)."""
  tile, rolled, kw, resident = 8, 2, dict(_PADDED, **dims, **F32), None
  if mode == "resident_out":
    tile = 16
  elif mode == "two_outputs":
    resident = 0
  elif mode == "unrolled_bf16_pools":
    rolled, kw = 0, dict(_PADDED, **dims)
  else:
    kw = dict(kw, lengths=[3, 2, 1] + [0] * 29 + [3, 1, 5], num_spec_tokens=2)
  lay = arg_specs.layout(**kw)
  args, kwargs = make(lay, seed=31)
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  arrays = {k: v for k, v in kwargs.items() if k not in STATIC}
  cfg = pallas_mosaic_tpu.Config(decode_tile=tile, chunk_size=64, min_chunked_tokens=128,
                                 decode_rolled=rolled)
  impl = pallas_mosaic_tpu.IMPLEMENTATION.replace(config=cfg)
  lowered = {}
  for skip in (True, False):
    with contextlib.ExitStack() as stack:
      stack.enter_context(mock.patch.object(pallas_mosaic_tpu, "_skip_idle", skip))
      if resident is not None:
        stack.enter_context(mock.patch.object(pallas_mosaic_tpu, "_RESIDENT_OUT_BYTES", resident))
      if interpret:
        stack.enter_context(config.interpret_mode())
      lowered[skip] = jax.jit(lambda a, kw: impl(*a, **kw, **static)).trace(
          tuple(args), arrays).lower()
  return (tuple(args), arrays, static), lowered


def check_padded_batch_skips_idle(programs):
  """Tiles and groups none of whose requests runs compute nothing
  (`DecodeStatic.skip_idle`): every output row and pool slot bit-identical
  to the kernel that computes them and selects them away, and both match
  the reference. Idle requests here are padding and requests with no
  tokens, whole tiles of them and the tail of running ones. `programs`:
  `padded_batch_programs`'s."""
  (args, arrays, static), lowered = programs
  assert lowered[True].as_text() != lowered[False].as_text(), "the switch did not take effect"
  results = {skip: lo.compile()(args, arrays) for skip, lo in lowered.items()}
  for got, want in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  (conv, rec), out = results[True]
  _assert_matches_reference(args, static, conv, rec, out, arrays)


@pytest.mark.parametrize("mode", SKIP_MODES)
def test_padded_batch_skips_idle_requests_bit_for_bit(mode):
  check_padded_batch_skips_idle(padded_batch_programs(mode))
