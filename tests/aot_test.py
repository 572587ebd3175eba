"""Compiling for real TPU generations on CPU (through libtpu), and the `aot` report.

GDN part: the GatedDeltaNet layer's call of `gated_delta_rule` with the
`pallas_mosaic_tpu` implementation, forward and forward+backward, on the GDN
arg specs tagged 'aot' and a length that is no multiple of any chunk, bf16,
heuristics config. A failed compile (bad block shape, layout, VMEM overflow)
fails the test. Then the report's pieces: the roofline formula against a hand
computation, the linear extrapolation of cycle estimates against a direct
estimate, the stored per-generation peaks against a fresh calibration, and
the command end to end.
"""

import json
import os
import subprocess
import sys

import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

from tokamax_gdn import aot
from tokamax_gdn import autotuning
from tokamax_gdn import cli
from tokamax_gdn import config
from tokamax_gdn.benchmarks import gated_delta_rule_aot as report_lib
from tokamax_gdn.ops.gated_delta_rule import workload

IMPL = "pallas_mosaic_tpu"
SHAPES = [workload.layer_shape(s.abstract()[0])
          for s in autotuning.arg_specs("gated_delta_rule", "aot")]
SHAPES.append(workload.LayerShape(b=1, t=4100, hk=8, hv=8, k=128, v=128))


@pytest.mark.aot
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("target", ["v5e", "v6e", "tpu7x"])
def test_gdn_pallas_mosaic_tpu_compiles(target, shape):
  mesh = aot.target_mesh(target)
  args = workload.abstract_inputs(shape, NamedSharding(mesh, P()))
  fwd_fn, fwd_bwd_fn = workload.layer_fns(IMPL)
  fwd = aot.compile_for(target, fwd_fn, *args, mesh=mesh)
  fwd_bwd = aot.compile_for(target, fwd_bwd_fn, *args, mesh=mesh)
  print(f"\n{target} {shape}: fwd {fwd}\nfwd+bwd {fwd_bwd}")
  # The forward keeps nothing per token beyond its output: temp is only the
  # padded/packed copies of the inputs (< 4x the inputs).
  assert fwd.temp_bytes < 4 * fwd.argument_bytes, fwd
  # fwd+bwd: chunk-entry states (f32 K·V per chunk of >= 64 tokens) + copies.
  states = shape.b * shape.hv * (-(-shape.t // 64)) * shape.k * shape.v * 4
  assert fwd_bwd.temp_bytes < states + 6 * fwd_bwd.argument_bytes, fwd_bwd


def test_roofline_formula_by_hand():
  s = workload.LayerShape(b=2, t=100, hk=2, hv=4, k=64, v=32, dtype=jnp.bfloat16)
  # Per token and value head at C=16: 2 (3·16·64 + 2·16·32 + 3·64·32) = 20480.
  assert workload.essential_flops(s, 16, backward=False) == 20480 * 200 * 4
  assert workload.essential_flops(s, 16, backward=True) == 3 * 20480 * 200 * 4
  qk = 2 * 200 * 2 * 64 * 2          # q and k: B·T·Hk·K bf16 each
  v = out = 200 * 4 * 32 * 2         # B·T·Hv·V bf16
  g_beta = 2 * 200 * 4 * 2           # B·T·Hv bf16 each
  fwd = qk + v + g_beta + out
  assert workload.min_hbm_bytes(s, backward=False) == fwd == 208000
  assert workload.min_hbm_bytes(s, backward=False, states=True) == fwd + 2 * 2 * 4 * 64 * 32 * 4
  again = qk + v + g_beta + out      # inputs and d_out read again
  grads = qk + v + g_beta            # dq, dk, dv, dg, dbeta written
  assert workload.min_hbm_bytes(s, backward=True) == fwd + again + grads == 572800


def test_roofline_cycles_are_the_larger_floor():
  gen = config.TPU_GENERATIONS["v6e"]
  r = aot.roofline_cycles("v6e", flops=gen.peak_flops_per_cycle * 1000,
                          hbm_bytes=gen.hbm_bytes_per_cycle * 3000)
  assert r["mxu_cycles"] == pytest.approx(1000) and r["hbm_cycles"] == pytest.approx(3000)
  assert r["floor_cycles"] == r["hbm_cycles"]


def test_extrapolate_is_proportional_or_the_line_through_two_points():
  assert report_lib.extrapolate([100], [512], 4096) == 800
  assert report_lib.extrapolate([100, 180], [256, 512], 4096) == 180 + 80 * (4096 - 512) / 256
  assert report_lib.extrapolate([100, 180], [256, 512], 256) == 100


@pytest.mark.aot
@pytest.mark.slow
def test_cycles_and_memory_scaled_from_a_short_length_match_a_direct_compile():
  """What `aot` reports for T=2048 from a compile at 512 (the default), against
  the estimate and memory of a compile at 2048 itself."""
  shape = dict(b=1, t=0, hk=2, hv=4, k=128, v=128, dtype="bfloat16")
  results = aot.compile_in_child("v6e", "tokamax_gdn.benchmarks.gated_delta_rule_aot:cycle_cases",
                                 dict(shape=shape, lengths=[512, 2048], passes=["fwd"]))
  short, full = (r.report for r in results)
  assert short and full, results
  scaled = report_lib.extrapolate([sum(short.kernel_cycles.values())], [512], 2048)
  assert scaled == pytest.approx(sum(full.kernel_cycles.values()), rel=0.05)
  for field in ("temp_bytes", "argument_bytes", "output_bytes"):
    scaled = report_lib.extrapolate([getattr(short, field)], [512], 2048)
    assert scaled == pytest.approx(getattr(full, field), rel=0.05), field


@pytest.mark.aot
@pytest.mark.slow
def test_stored_peaks_are_what_the_estimator_measures():
  gen = config.TPU_GENERATIONS["v6e"]
  measured = aot.calibrate("v6e")
  assert measured["peak_flops_per_cycle"] == pytest.approx(gen.peak_flops_per_cycle, rel=0.01)
  assert measured["hbm_bytes_per_cycle"] == pytest.approx(gen.hbm_bytes_per_cycle, rel=0.01)


@pytest.mark.aot
def test_aot_command_reports_kernels_glue_total_and_roofline(capsys):
  rc = cli.main(["aot", "--target", "v6e", "--hk", "1", "--hv", "2", "--k", "128", "--v", "128",
                 "--seq-len", "1024", "--cycle-lengths", "256", "--json"])
  (report,) = json.loads(capsys.readouterr().out)
  assert rc == 0, report
  passes = {p["pass_"]: p for p in report["passes"]}
  assert set(passes) == {"fwd", "fwd+bwd"}
  # libtpu's estimator aborts on some backward kernels (an LLO_CHECK): such a
  # pass says why and still gets its memory, from a compile at the full length.
  estimated = {k: p for k, p in passes.items() if p["total_cycles"] is not None}
  assert "fwd" in estimated, passes["fwd"]
  for p in passes.values():
    assert p["compiled"] == "ok" and p["argument_bytes"] > 0 and p["output_bytes"] > 0, p
    assert p["floor_cycles"] == max(p["mxu_cycles"], p["hbm_cycles"]) > 0
    if p["pass_"] not in estimated:
      assert p["memory_from"] == "T=1024" and p["note"].startswith("no cycle estimate: "), p
  for p in estimated.values():
    assert p["memory_from"] == "T=[256] scaled", p
    kernels = p["kernels"]
    assert report_lib.GLUE in kernels and any(n.startswith("gdn_") for n in kernels), kernels
    assert all(n.startswith("gdn_") for n in kernels if n != report_lib.GLUE), kernels
    assert p["total_cycles"] == sum(kernels.values()) > 0
    assert p["total_over_floor"] == pytest.approx(p["total_cycles"] / p["floor_cycles"])


_HOLD_LIBTPU = """
from jax.experimental import topologies
topologies.get_topology_desc(topology_name="v6e:2x2", platform="tpu")
print("holding", flush=True)
input()
"""
_COMPILE = """
import jax.numpy as jnp
from tokamax_gdn import aot
print(aot.compile_for("v6e", lambda x: x + 1, ((8, 128), jnp.float32)).output_bytes)
"""


@pytest.mark.aot
def test_aot_compiles_while_another_process_holds_libtpu():
  """libtpu refuses a second process ("Internal error when accessing libtpu
  multi-process lockfile") unless told that it may share; `aot` only
  compiles, so it says so itself."""
  env = {k: v for k, v in os.environ.items() if k != "ALLOW_MULTIPLE_LIBTPU_LOAD"}
  env["JAX_PLATFORMS"] = "cpu"
  holder = subprocess.Popen([sys.executable, "-c", _HOLD_LIBTPU], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
  try:
    assert holder.stdout.readline().strip() == "holding"
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                          env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-1500:]
    assert proc.stdout.split()[-1] == str(8 * 128 * 4)
  finally:
    holder.communicate("\n", timeout=60)
