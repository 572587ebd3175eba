"""`training.flops` (model FLOPs for MFU) against a hand count, and
`training.step_split` (the device-time buckets) on synthetic HLO text and
trace events: what `tokamax-gdn train --profile-step / --compare-impls`
report on a TPU, checked without one."""

import jax
import pytest

from tokamax_gdn.models import decoder
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.training import flops
from tokamax_gdn.training import step_split as ss

from tests.cli.train_test import _TOY   # one GDN block, one attention block, MoE top 1 of 2


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
  path = tmp_path_factory.mktemp("toy") / "toy.yml"
  path.write_text(_TOY)
  return ModelConfig.load(str(path))


def test_active_params_hand_count(toy):
  # GDN in_proj: 32 x (q 16 + k 16 + v 32 + z 32 + b 2 + a 2 = 100), out_proj 32 x 32.
  gdn = 32 * 100 + 32 * 32
  # Attention: q 32x32, k and v 32x16 (one KV head), o 32x32.
  attention = 32 * 32 + 2 * 32 * 16 + 32 * 32
  # Per block: router 32x2 and one expert's gate, up, down (32x16 each).
  moe = 32 * 2 + 1 * 3 * 32 * 16
  lm_head = 32 * 8
  assert flops.active_matmul_params(toy) == gdn + attention + 2 * moe + lm_head == 10752


def test_active_params_match_the_model_params(toy):
  """The count equals the model's weight matrices (the experts' scaled by
  top-k / E), so it follows the param layout, not a copy of it."""
  shapes = jax.eval_shape(lambda: decoder.init_params(jax.random.key(0), toy))
  dense = ("in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "router", "lm_head")
  experts = ("gate_proj", "up_proj", "down_proj")
  total = 0.0
  for path, leaf in jax.tree_util.tree_leaves_with_path(shapes):
    name = str(getattr(path[-1], "key", ""))
    if name in dense:
      total += leaf.size
    elif name in experts:
      total += leaf.size * toy.num_experts_per_tok / toy.num_experts
  assert flops.active_matmul_params(toy) == total


def test_step_flops_hand_count(toy):
  b, t = 2, 8
  tokens = b * t
  matmul = 6 * 10752 * tokens
  # Causal attention: Q Kᵀ and P V over half the T x T square, 2 heads of 16; x3 for fwd+bwd.
  attention = 3 * (2 * 2 * b * t * t * 2 * 16 // 2)
  # GDN per token and value head at chunk 64, K = V = 16: 2 (3 C K + 2 C V + 3 K V); 2 heads.
  per_token_head = 2 * (3 * 64 * 16 + 2 * 64 * 16 + 3 * 16 * 16)
  conv = 2 * 4 * 64 * tokens          # width 4, conv channels q + k + v = 64
  gdn = 3 * (per_token_head * tokens * 2 + conv)
  got = flops.step_flops(toy, b, t)
  assert (got.matmul, got.attention, got.gdn) == (matmul, attention, gdn)
  assert got.total == matmul + attention + gdn
  assert flops.mfu(got.total, 1e-3, 1e12) == pytest.approx(got.total / 1e-3 / 1e12)
  assert flops.mfu(got.total, 1e-3, None) is None


# A compiled module's text as XLA prints it: stack-frame tables, then
# instructions with metadata (abridged).
_HLO = r"""HloModule jit_step, is_scheduled=true

FileNames
1 "/src/tokamax_gdn/models/blocks.py"
2 "/src/tokamax_gdn/ops/gated_delta_rule/xla.py"
3 "/src/tokamax_gdn/models/softmax_attention.py"
4 "/site/jax/experimental/pallas/ops/tpu/splash_attention/splash_attention_kernel.py"

FunctionNames
1 "attention"
2 "matmul"
3 "chunked"
4 "splash_attention"
5 "_splash_attention_bwd"

FileLocations
1 {file_name_id=1 function_name_id=1 line=105 end_line=105 column=2 end_column=9}
2 {file_name_id=1 function_name_id=2 line=40 end_line=40 column=2 end_column=9}
3 {file_name_id=2 function_name_id=3 line=7 end_line=7 column=2 end_column=9}
4 {file_name_id=3 function_name_id=4 line=90 end_line=90 column=2 end_column=9}
5 {file_name_id=4 function_name_id=5 line=900 end_line=900 column=2 end_column=9}

StackFrames
1 {file_location_id=1 parent_frame_id=1}
2 {file_location_id=2 parent_frame_id=1}
3 {file_location_id=3 parent_frame_id=1}
4 {file_location_id=4 parent_frame_id=1}
5 {file_location_id=5 parent_frame_id=1}

ENTRY %main.1 (p: f32[8]) -> f32[8] {
  %gdn_bwd.18 = (f32[8]) custom-call(f32[8] %p), custom_call_target="tpu_custom_call", metadata={op_name="x" metadata_payload="tokamax:{\"op\":{\"__type\":\"tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu.PallasMosaicTpuGatedDeltaRuleVjp\"}}"}
  %eval_jaxpr.53 = f32[8] custom-call(f32[8] %p), custom_call_target="tpu_custom_call", metadata={op_name="x" metadata_payload="tokamax:{\"op\":{\"__type\":\"tokamax_gdn.ops.causal_conv1d.pallas_mosaic_tpu.PallasMosaicTpuCausalConv1dVjp\"}}"}
  %fusion.7 = f32[8] fusion(f32[8] %p), kind=kLoop, calls=%f, metadata={op_name="x" stack_frame_id=3}
  %tokamax_gdn_gmm.76 = f32[8] custom-call(f32[8] %p), custom_call_target="tpu_custom_call", metadata={op_name="x" metadata_payload="tokamax:{\"op\":{\"__type\":\"tokamax_gdn.ops.gmm.pallas_mosaic_tpu.PallasMosaicTpuGmm\"}}"}
  %ragged-dot-none.10 = f32[8] ragged-dot(f32[8] %p, f32[8] %p, s32[2] %g), metadata={op_name="x"}
  %convolution.9 = f32[8] convolution(f32[8] %p, f32[8] %p), metadata={op_name="x" stack_frame_id=1}
  %splash_mqa_fwd_residuals.2 = f32[8] custom-call(f32[8] %p), custom_call_target="tpu_custom_call", metadata={op_name="x" stack_frame_id=4}
  %splash_mqa_dkv_no_residuals.1 = f32[8] custom-call(f32[8] %p), custom_call_target="tpu_custom_call", metadata={op_name="x" stack_frame_id=5}
  %fusion.11 = f32[8] fusion(f32[8] %p), kind=kLoop, calls=%f, metadata={op_name="x" stack_frame_id=5}
  %transpose.4 = f32[8] transpose(f32[8] %p), dimensions={0}, metadata={op_name="x" stack_frame_id=4}
  %convolution.10 = f32[8] convolution(f32[8] %p, f32[8] %p), metadata={op_name="jit(step)/transpose(jvp())/while/body/...h,hp->...p/dot_general" stack_frame_id=2}
  %while.3 = (f32[8]) while((f32[8]) %t), condition=%c, body=%b
  ROOT %add.1 = f32[8] add(f32[8] %p, f32[8] %p)
}
"""


def test_parse_hlo_reads_op_types_and_frames():
  ins = ss.parse_hlo(_HLO)
  assert ins["convolution.9"].function == "attention"
  assert ins["convolution.9"].file.endswith("models/blocks.py")
  assert ins["while.3"].opcode == "while" and ins["gdn_bwd.18"].opcode == "custom-call"
  assert ins["ragged-dot-none.10"].opcode == "ragged-dot"
  assert ins["eval_jaxpr.53"].op_type.endswith("PallasMosaicTpuCausalConv1dVjp")


@pytest.mark.parametrize("name, bucket", [
    ("gdn_bwd.18", ss.GDN),            # Op stamp: a Pallas kernel
    ("eval_jaxpr.53", ss.GDN),         # the causal conv's kernel has no name of its own
    ("fusion.7", ss.GDN),              # innermost frame in ops/gated_delta_rule/
    ("tokamax_gdn_gmm.76", ss.GMM),
    ("ragged-dot-none.10", ss.GMM),    # xla's gmm
    ("convolution.9", ss.ATTENTION),   # inside models.blocks.attention
    ("splash_mqa_fwd_residuals.2", ss.ATTENTION),   # a splash kernel ...
    ("transpose.4", ss.ATTENTION),     # ... and its glue: frames in models/softmax_attention.py
    # a splash kernel whose innermost frame is in jax's library (the backward,
    # as the chip's step showed): by its kernel name; other instructions
    # from library frames stay in rest
    ("splash_mqa_dkv_no_residuals.1", ss.ATTENTION),
    ("fusion.11", ss.REST),
    ("convolution.10", ss.REST),       # a projection (models.blocks.matmul)
    ("add.1", ss.REST),
    ("%add.1", ss.REST),
])
def test_classify_by_module(name, bucket):
  assert ss.classify_name(name, ss.parse_hlo(_HLO)) == bucket


@pytest.mark.parametrize("name, bucket", [
    ("gdn_fwd", ss.GDN), ("gdn_fwd_states.2", ss.GDN), ("tokamax_gdn_tgmm", ss.GMM),
    ("tokamax_gdn_gmm.3", ss.GMM), ("ragged-dot.1", ss.GMM), ("fusion.12", ss.REST),
    ("gdnx", ss.REST), ("splash_mqa_dkv_no_residuals.1", ss.ATTENTION),
    ("gated_rmsnorm_bwd.2", ss.REST),
])
def test_classify_by_kernel_name(name, bucket):
  """Events whose name is no instruction of the module (a profiler naming
  the kernel, not the instruction) go by kernel name."""
  assert ss.classify_name(name) == bucket


def test_bucket_totals_of_an_op_list():
  ops = [("gdn_fwd", 3.0), ("gdn_bwd", 5.0), ("tokamax_gdn_gmm", 2.0), ("tokamax_gdn_tgmm", 1.0),
         ("fusion.1", 4.0), ("convolution.9", 0.5)]
  assert ss.bucket_totals(ops, ss.parse_hlo(_HLO)) == {
      ss.GDN: 8.0, ss.GMM: 3.0, ss.ATTENTION: 0.5, ss.REST: 4.0}


def _meta(pid, tid, process, thread):
  return [dict(ph="M", name="process_name", pid=pid, args=dict(name=process)),
          dict(ph="M", name="thread_name", pid=pid, tid=tid, args=dict(name=thread))]


def _ev(pid, tid, name, ts, dur, **args):
  return dict(ph="X", pid=pid, tid=tid, name=name, ts=ts, dur=dur, args=args)


def test_device_split_of_a_trace():
  """Only the TPU's "XLA Ops" track counts; a loop's event counts its own
  time, not its body's; names resolve through `long_name` first."""
  events = (_meta(1, 1, "/device:TPU:0", "XLA Ops") + _meta(1, 2, "/device:TPU:0", "XLA Modules")
            + _meta(9, 1, "/host:CPU", "python"))
  events += [
      _ev(1, 1, "while.3", 0, 100),                 # around the four below: 10 us of its own
      _ev(1, 1, "gdn_bwd.18", 0, 40),
      _ev(1, 1, "tokamax_gdn_gmm.76", 40, 20),
      _ev(1, 1, "conv", 60, 20, long_name="%convolution.9 = f32[8] convolution(...)"),
      _ev(1, 1, "fusion.99", 80, 10),
      _ev(1, 2, "jit_step", 0, 100),                # the module: not an op
      _ev(9, 1, "gdn_bwd.18", 0, 1000),             # host: not the device
  ]
  split = ss.device_split(events, _HLO, calls=2)
  us = lambda x: x * 1e-6 / 2
  assert split == pytest.approx({ss.GDN: us(40), ss.GMM: us(20), ss.ATTENTION: us(20),
                                 ss.REST: us(20), "device": us(100), "attributed": 0.9})


def test_device_split_off_tpu_is_none():
  events = _meta(1, 1, "/host:CPU", "tf_XLACpu") + [_ev(1, 1, "fusion.1", 0, 5)]
  assert ss.device_split(events, _HLO) is None


def test_self_times_of_nested_events():
  outer, a, b = _ev(1, 1, "o", 0, 10), _ev(1, 1, "a", 1, 3), _ev(1, 1, "b", 5, 2)
  inner = _ev(1, 1, "i", 5.5, 1)
  got = {e["name"]: t for e, t in ss.self_times([outer, a, b, inner])}
  assert got == {"o": 5, "a": 3, "b": 1, "i": 1}


def test_top_instructions_of_a_trace():
  """Per instruction, most device time first: a loop's event counts its own
  time; an instruction run twice a call sums (and counts its events); names
  resolve through `long_name`; pass and op come from JAX's op name, source
  from the innermost frame; a kernel the module does not name keeps its
  event name and goes by kernel name."""
  events = _meta(1, 1, "/device:TPU:0", "XLA Ops") + _meta(9, 1, "/host:CPU", "python")
  for call in range(2):
    t0 = 1000 * call
    events += [
        _ev(1, 1, "while.3", t0, 100),            # 10 us of its own
        _ev(1, 1, "gdn_bwd.18", t0, 40),
        _ev(1, 1, "mm", t0 + 40, 15, long_name="%convolution.10 = f32[8] convolution(...)"),
        _ev(1, 1, "mm", t0 + 55, 15, long_name="%convolution.10 = f32[8] convolution(...)"),
        _ev(1, 1, "gdn_fwd_states.7", t0 + 70, 20),   # not in the module
        _ev(1, 1, "fusion.7", t0 + 100, 5),
        _ev(9, 1, "gdn_bwd.18", t0, 500),         # host: not the device
    ]
  rows = ss.top_instructions(events, _HLO, n=4, calls=2)
  assert [r["instruction"] for r in rows] == ["gdn_bwd.18", "convolution.10",
                                              "gdn_fwd_states.7", "while.3"]
  by = {r["instruction"]: r for r in rows}
  assert by["gdn_bwd.18"]["ms"] == pytest.approx(0.040)
  assert by["gdn_bwd.18"]["share"] == pytest.approx(40 / 105)
  assert by["gdn_bwd.18"]["bucket"] == ss.GDN and by["gdn_fwd_states.7"]["bucket"] == ss.GDN
  mm = by["convolution.10"]
  assert mm["ms"] == pytest.approx(0.030) and mm["events"] == 2
  assert (mm["bucket"], mm["pass"], mm["op"], mm["source"]) == (
      ss.REST, "bwd", "dot_general", "blocks.py:matmul")
  assert by["gdn_fwd_states.7"]["source"] == "" and by["while.3"]["ms"] == pytest.approx(0.010)
  assert len(ss.top_instructions(events, _HLO, n=20, calls=2)) == 5


def test_top_instructions_off_tpu_is_none():
  events = _meta(1, 1, "/host:CPU", "tf_XLACpu") + [_ev(1, 1, "fusion.1", 0, 5)]
  assert ss.top_instructions(events, _HLO) is None
