"""The serving benchmark's programs (`benchmarks/serving.py`) on CPU, tiny specs:
N calls chained in one program give what N separate calls give, keep every
call's work inside the loop (checked in the compiled HLO), and the peers'
calls are built or fail with their reason."""

import jax
import numpy as np
import pytest

from tokamax_gdn.benchmarks import serving
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

SPEC = "tiny_mixed_padded_ctx"     # decodes, prefills, padding: both of xla's loops


def _inputs(name=SPEC):
  args, kwargs = arg_specs.by_name(name).make(jax.random.key(3))
  arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
  return args, kwargs, args[:3] + args[5:], arrays


def test_chained_calls_are_the_calls_one_by_one():
  """Three calls in one program: the pools carried from call to call, the
  last output returned, as three calls of the one-call program."""
  args, kwargs, rest, arrays = _inputs()
  step = serving.jitted_step("xla", kwargs)
  pools = (args[3].copy(), args[4].copy())
  for _ in range(3):
    pools, out = step(*pools, rest, arrays)
  (conv, rec), c_out = serving.chained_program("xla", kwargs, 3)(
      args[3].copy(), args[4].copy(), rest, arrays)
  for x, y in ((conv, pools[0]), (rec, pools[1]), (c_out, out)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6)
  # Each call moved the states on: a chain of 1 is not a chain of 3.
  (_, rec1), _ = serving.chained_program("xla", kwargs, 1)(
      args[3].copy(), args[4].copy(), rest, arrays)
  assert not np.allclose(np.asarray(rec1), np.asarray(rec))


@pytest.mark.parametrize("impl", ["xla", serving.TOKAMAX])
def test_every_calls_work_stays_in_the_loop(impl):
  """The compiled chained program does nothing with its inputs outside the
  loop; without the barrier XLA hoists the work that reads only the inputs
  (the gates, the request metadata), the same in every iteration."""
  args, kwargs, rest, arrays = _inputs()
  lower = lambda tie: serving.chained_program(impl, kwargs, 4, tie_inputs=tie).lower(
      args[3], args[4], rest, arrays).compile().as_text()
  assert serving.loop_invariant_ops(lower(True)) == []
  assert serving.loop_invariant_ops(lower(False))


def test_loop_invariant_ops_reads_the_entry_computation():
  hlo = """HloModule m

%body (p: (s32[], f32[4])) -> (s32[], f32[4]) {
  %p = (s32[], f32[4]{0}) parameter(0)
  ROOT %t = (s32[], f32[4]{0}) tuple(%p)
}

ENTRY %main (a: f32[4], b: f32[4]) -> (f32[4]) {
  %a = f32[4]{0} parameter(0)
  %b = f32[4]{0} parameter(1)
  %c = f32[] constant(0)
  %zeros = f32[4]{0} broadcast(%c), dimensions={}
  %hoisted = f32[4]{0} fusion(%b, %zeros), kind=kLoop, calls=%f
  %init = (s32[], f32[4]{0}) tuple(%c, %a)
  %w = (s32[], f32[4]{0}) while(%init), condition=%cond, body=%body
  %x = f32[4]{0} get-tuple-element(%w), index=1
  %sum = f32[4]{0} add(%x, %hoisted)
  ROOT %r = (f32[4]{0}) tuple(%sum)
}
"""
  # The loop's result and the moves around it are not work; `zeros` reads no
  # parameter; `hoisted` does, and so does what reads it.
  assert serving.loop_invariant_ops(hlo) == ["hoisted (fusion)", "sum (add)"]


def test_peers_calls():
  """The drop-in runs as ours; vLLM's kernel needs tpu-inference's files
  (ImportError naming them) and a TPU; an unknown name is a ValueError."""
  args, kwargs, rest, arrays = _inputs()
  # (The drop-in donates its pools.)
  ((conv, rec), out) = serving.op_call(serving.VLLM_DROPIN, kwargs)(
      args[3].copy(), args[4].copy(), rest, arrays)
  ((r_conv, r_rec), r_out) = serving.op_call("xla", kwargs)(args[3], args[4], rest, arrays)
  for x, y in ((conv, r_conv), (rec, r_rec), (out, r_out)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  try:
    import tpu_inference  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    with pytest.raises(ImportError, match="tpu-inference"):
      serving.op_call(serving.VLLM, kwargs)
  with pytest.raises(ValueError, match="no_such_impl"):
    serving.op_call("no_such_impl", kwargs)


def test_chain_of_no_calls_is_refused():
  _, kwargs, _, _ = _inputs()
  with pytest.raises(ValueError, match="calls must be >= 1"):
    serving.chained_program("xla", kwargs, 0)


@pytest.mark.aot
def test_chained_pallas_program_keeps_its_work_in_the_loop_on_v5e():
  """Compiled for the chip (both of the Pallas paths: prefills of 256 and
  128 tokens beside each other), the chained program does nothing with its
  inputs outside the loop either."""
  from tokamax_gdn import aot  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.aot import serving as serving_aot  # pylint: disable=g-import-not-at-top
  mesh = aot.target_mesh("v5e")
  args, arrays, static = serving_aot._abstract(arg_specs.by_name("tp8_mixed_3x512"), mesh)  # pylint: disable=protected-access
  with aot.on_target(mesh):
    hlo = serving.chained_program("pallas_mosaic_tpu", static, 4).lower(
        args[3], args[4], args[:3] + args[5:], arrays).compile().as_text()
  assert serving.loop_invariant_ops(hlo) == []
  assert "gdn_serve_decode" in hlo


def test_a_peer_that_fails_is_a_row_with_its_reason(monkeypatch):
  """`run` (the CPU timing): an implementation whose call raises gives a
  row with the error and no time; the others are still timed."""
  real = serving.jitted_step

  def jitted_step(impl, kwargs, *a, **kw):
    if impl == "broken":
      def fail(*_):
        raise ValueError("cannot run here")
      return fail
    return real(impl, kwargs, *a, **kw)

  monkeypatch.setattr(serving, "jitted_step", jitted_step)
  rows = serving.run([arg_specs.by_name(SPEC)], ("xla", "broken"), reps=1)
  by_impl = {r["impl"]: r for r in rows}
  assert by_impl["broken"]["ms"] is None
  assert "cannot run here" in by_impl["broken"]["error"]
  assert by_impl["xla"]["ms"] > 0 and by_impl["xla"]["error"] is None
