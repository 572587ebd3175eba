"""One whole training step (forward, custom VJPs, AdamW) with the Pallas
kernels compiles for a tpu7x slice (2-way data x 2-way model) on CPU, through
libtpu. The model is qwen3.5-tiny's structure (GVA 1:2, GDN and attention
blocks, routed MoE) at toy width: the compile's cost is the number of distinct
kernels and programs, not the width, and the width is what `tokamax-gdn aot
--train-step --model qwen3.5-tiny` changes."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import re  # pylint: disable=g-import-not-at-top

import pytest  # pylint: disable=g-import-not-at-top

from tokamax_gdn import cli  # pylint: disable=g-import-not-at-top
from tokamax_gdn import layers  # pylint: disable=g-import-not-at-top
from tokamax_gdn.aot import training as train_aot  # pylint: disable=g-import-not-at-top
from tokamax_gdn.models import ModelConfig  # pylint: disable=g-import-not-at-top

# Head dims of 32 and widths of 64 are the smallest the Pallas TPU kernels
# tile; 2 key / 4 value heads split over a 2-way "model" axis.
TOY = ModelConfig(
    gdn=layers.GatedDeltaNetConfig(hidden_size=64, num_k_heads=2, num_v_heads=4, head_k_dim=32,
                                   head_v_dim=32),
    num_layers=2, full_attention_interval=2, num_attention_heads=2, num_key_value_heads=2,
    head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=64)


@pytest.mark.aot
def test_train_step_compiles_for_tpu7x():
  report = train_aot.compile_train_step(TOY, target="tpu7x", batch=2, seq_len=64,
                                        mesh_shape=(2, 2))
  assert report.mesh_shape == (2, 2)
  # GDN forward/backward, conv forward/backward and gmm/tgmm run as Mosaic kernels.
  assert report.mosaic_kernels >= 6, report
  # Params + AdamW moments (f32) split over "model" only for the experts:
  # at least their replicated part must be on every device.
  experts = _expert_params(TOY)
  replicated = 3 * 4 * (report.param_count - experts) + 3 * 4 * experts // 2
  assert report.argument_bytes >= replicated, report
  assert report.temp_bytes > 0
  print(report, report.rows())


def _expert_params(cfg):
  return cfg.num_layers * 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size


@pytest.mark.parametrize("argv, match", [
    (["aot", "--train-step", "--model", "qwen3.5-tiny", "--mesh", "2by4"], "expected DATAxMODEL"),
    (["aot", "--train-step"], "needs --model"),
])
def test_train_step_command_rejects_bad_arguments(argv, match, capsys):
  assert cli.main(argv) == 2
  assert re.search(match, capsys.readouterr().err)
