"""One whole training step of qwen3.5-tiny (forward, custom VJPs, AdamW) with
the Pallas kernels compiles for a tpu7x 2x2x1 slice (2-way data x 4-way model)
on CPU, through libtpu."""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import pytest  # pylint: disable=g-import-not-at-top

from tokamax_gdn.models import ModelConfig  # pylint: disable=g-import-not-at-top
from tokamax_gdn.training.aot import compile_train_step  # pylint: disable=g-import-not-at-top

pytestmark = [pytest.mark.aot, pytest.mark.slow]


def test_tiny_train_step_compiles_for_tpu7x():
  cfg = ModelConfig.load("qwen3.5-tiny")
  report = compile_train_step(cfg, target="tpu7x", batch=2, seq_len=256, mesh_shape=(2, 4))
  assert report.mesh_shape == (2, 4)
  # GDN forward/backward, conv forward/backward and gmm/tgmm run as Mosaic kernels.
  assert report.mosaic_kernels >= 6, report
  # Params + AdamW moments (f32) split over "model" only for the experts:
  # at least their replicated part must be on every device.
  replicated = 3 * 4 * (report.param_count - _expert_params(cfg)) + 3 * 4 * _expert_params(cfg) // 4
  assert report.argument_bytes >= replicated, report
  assert report.temp_bytes > 0
  print(report, report.rows())


def _expert_params(cfg):
  return cfg.num_layers * 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size
