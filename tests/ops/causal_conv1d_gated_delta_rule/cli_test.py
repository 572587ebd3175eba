"""`tokamax-gdn bench` and `tokamax-gdn aot` for the serving op, on tiny specs."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import cli
from tokamax_gdn import config
from tokamax_gdn.aot import serving as serving_aot
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

OP = "causal_conv1d_gated_delta_rule"


def test_bench_times_ours_and_tokamax_in_one_run(capsys):
  assert cli.main(["bench", "--op", OP, "--specs", "tiny_decode_8_ctx", "--reps", "1",
                   "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  by_impl = {r["impl"]: r for r in rows}
  assert set(by_impl) == {"xla", "tokamax_xla"}
  assert all(r["spec"] == "tiny_decode_8_ctx" and r["ms"] > 0 for r in rows)
  assert by_impl["xla"]["tokamax_over_this"] == pytest.approx(
      by_impl["tokamax_xla"]["ms"] / by_impl["xla"]["ms"])
  assert by_impl["tokamax_xla"]["tokamax_over_this"] == pytest.approx(1.0)


def test_hbm_floor_bytes_by_hand():
  """tiny_mixed_padded_ctx: requests of [1, 1, 1, 9, 2, 17] tokens, contexts
  [4, 4, 4, 0, 3, 0]: the three decodes and the 2-token continuation read a
  slot, every request writes one; f32 everywhere."""
  spec = arg_specs.by_name("tiny_mixed_padded_ctx")
  dim, n_v, d_k, d_v, width = 2 * 16 + 2 * 16, 2, 16, 16, 4
  slot = 4 * ((width - 1) * dim + n_v * d_k * d_v)
  tokens = 1 + 1 + 1 + 9 + 2 + 17
  per_token = 4 * (dim + n_v + n_v + n_v * d_v)
  assert serving_aot.hbm_bytes(spec) == (4 + 6) * slot + tokens * per_token
  floor = serving_aot.hbm_bytes(spec) / config.TPU_GENERATIONS["v6e"].hbm_bytes_per_cycle
  assert np.isfinite(floor) and floor > 0


def test_negative_chain_is_refused(capsys):
  assert cli.main(["bench", "--op", OP, "--chain", "-1"]) == 2
  assert "--chain must be >= 0" in capsys.readouterr().err


def test_essential_flops_by_hand():
  """tiny_mixed_padded_ctx: 31 valid tokens, 2 value heads, K = V = 16; the
  chunked algorithm at C = 64: 2 (3 C K + 2 C V + 3 K V) per token and head."""
  per_token_head = 2 * (3 * 64 * 16 + 2 * 64 * 16 + 3 * 16 * 16)
  spec = arg_specs.by_name("tiny_mixed_padded_ctx")
  assert serving_aot.essential_flops(spec) == 31 * 2 * per_token_head
  assert serving_aot.essential_flops(spec, chunk=32) < serving_aot.essential_flops(spec)


@pytest.mark.aot
def test_aot_command_prints_cycles_floor_and_ratio(capsys):
  assert cli.main(["aot", "--op", OP, "--target", "v6e", "--specs", "tiny_decode_8_ctx",
                   "--implementation", "xla", "--json"]) == 0
  (row,) = json.loads(capsys.readouterr().out)
  assert row["spec"] == "tiny_decode_8_ctx" and row["compiled"] == "ok"
  assert row["total_cycles"] == sum(row["kernels"].values()) > 0
  assert row["total_over_floor"] == pytest.approx(row["total_cycles"] / row["floor_cycles"])
  assert row["loop_steps"] == {"decode": 1, "prefill": 0}
