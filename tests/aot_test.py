"""Compiling for real TPU generations on CPU (through libtpu), and the `aot` report.

GDN part: the GatedDeltaNet layer's call of `gated_delta_rule` with the
`pallas_mosaic_tpu` implementation, value and gradients in one compile (the
forward, states and backward kernels), on the GDN arg specs tagged 'aot' for
v5e, v6e and tpu7x, and a length that is no multiple of any chunk, bf16,
heuristics config. A failed compile (bad block shape, layout, VMEM overflow)
fails the test. Then the report's pieces: the roofline formula against a hand
computation, the linear extrapolation of cycle estimates against a direct
estimate, the stored per-generation peaks against a fresh calibration, and
the command end to end.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import pytest

from tokamax_gdn import aot
from tokamax_gdn import cli
from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.aot import gated_delta_rule as report_lib
from tokamax_gdn.benchmarks import workload

IMPL = "pallas_mosaic_tpu"
QWEN = [workload.layer_shape(s.abstract()[0])
        for s in registry.arg_specs("gated_delta_rule", "aot")]
KERNELS = ("gdn_fwd", "gdn_fwd_states", "gdn_bwd")


def _check_compiles(target, shape):
  mesh = aot.target_mesh(target)
  args = workload.abstract_inputs(shape, NamedSharding(mesh, P()))
  fn = workload.layer_fns(shape, IMPL)[1]   # value and gradients: all three kernels
  with aot.on_target(mesh):
    hlo = jax.jit(fn).lower(*args).as_text()
  for name in KERNELS:   # each Pallas kernel by its name (not a prefix of another)
    assert re.search(rf"\b{name}(?![_a-z])", hlo), name
  rep = aot.compile_for(target, fn, *args, mesh=mesh)
  print(f"\n{target} {shape}: {rep}")
  # Residuals live during the backward: the chunk-entry states and WY
  # inverses (bf16, chunks of >= 64 tokens), plus copies of the inputs.
  chunks = -(-shape.t // 64)
  residuals = shape.b * shape.hv * chunks * (shape.k * shape.v + 64 * 64) * 2
  assert rep.temp_bytes < residuals + 6 * rep.argument_bytes, rep


@pytest.mark.aot
@pytest.mark.parametrize("target", ["v6e", "tpu7x"])
def test_gdn_training_step_compiles_at_the_qwen_shape(target):
  """Forward, states pass and backward at Qwen3-Next's per-chip shape (T=4096,
  Hk=16, Hv=32, K=V=128, bf16) with the heuristics: block shapes, layouts and
  VMEM (tpu7x has half the VMEM of v5e/v6e) must all hold. (v5e runs this
  step on the chip: tests/tpu's GDN layer tests, bf16 and float32 (whose
  backward once needed 56.36 MiB of v5e's 53: the VMEM model had no float32
  term), and `tokamax-gdn bench`; here its 64-value-head compile below.)"""
  (shape,) = QWEN
  _check_compiles(target, shape)


@pytest.mark.aot
def test_gdn_training_step_compiles_at_64_value_heads_on_v5e():
  """Qwen3.5-397B's GDN heads on one chip (Hk=16, Hv=64), T=8192: the
  backward at C = 128 needs over v5e's 53 MiB cap at any interleave there
  (53.01 MiB with 4 heads; the heuristics had picked 8); the estimate's
  long-T growth per 16 value heads takes it to C = 64."""
  _check_compiles("v5e", workload.LayerShape(b=1, t=8192, hk=16, hv=64, k=128, v=128))


@pytest.mark.aot
def test_gdn_training_step_compiles_with_a_partial_last_chunk():
  _check_compiles("v6e", workload.LayerShape(b=1, t=4100, hk=8, hv=8, k=128, v=128))


@pytest.mark.aot
def test_gdn_training_step_compiles_at_t32768():
  """docs/design.md's long-T claim on a TPU target: value and gradients at
  T=32768 (the finiteness itself is checked in interpret mode at T=4096 and
  for xla at T=32768 in tests/ops/gated_delta_rule/stress_test.py)."""
  _check_compiles("v6e", workload.LayerShape(b=1, t=32768, hk=2, hv=4, k=128, v=128))


@pytest.mark.aot
def test_the_measured_grad_program_keeps_the_forward_kernel():
  """What `aot` and autotuning compile as "fwd+bwd" (`workload.layer_fns`)
  must run the forward kernel, as a model's training step does; a loss that
  does not use the outputs' values (sum(out)) loses it, and so must fail the
  same check."""
  mesh = aot.target_mesh("v6e")
  s = workload.LayerShape(b=1, t=128, hk=1, hv=2, k=128, v=128)
  args = workload.abstract_inputs(s, NamedSharding(mesh, P()))
  forward, grad = workload.layer_fns(s, IMPL)
  step = {name: 1 for name in KERNELS}
  assert aot.compile_for("v6e", grad, *args, mesh=mesh).pallas_calls == step
  plain_sum = jax.grad(lambda *xs: jnp.sum(forward(*xs).astype(jnp.float32)),
                       argnums=tuple(range(7)))
  assert aot.compile_for("v6e", plain_sum, *args, mesh=mesh).pallas_calls != step


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


def test_a_crash_in_the_cycle_estimator_is_named_as_the_estimates():
  """libtpu's static cycle estimator aborts on some kernels (v5e, the serving
  decode's cost model at 64-head specs): the reason a row shows names the
  estimator, so that it does not read as a kernel that fails to compile."""
  from tokamax_gdn.aot import compiler  # pylint: disable=g-import-not-at-top
  stderr = "\n".join([
      "WARNING: could not determine TPU accelerator type",
      "F1207 02:56:27.191 3850 llo_execution_graph.cc:132] unexpected edge",
      "platforms/xla/service/jellyfish/static_llo_profile/llo_execution_graph.cc:132",
      "E1207 02:56:27.191659 3850 process_state.cc:794] RAW: Raising signal 6"])
  reason = compiler._crash(stderr, "exit code -6")  # pylint: disable=protected-access
  assert reason.startswith(compiler.ESTIMATOR_ABORTED), reason
  assert "llo_execution_graph.cc:132" in reason and reason.endswith("(child process: exit code -6)")
  other = compiler._crash("F1207 mosaic.cc:10] Check failed: x == y", "exit code -6")  # pylint: disable=protected-access
  assert other == "child process died (exit code -6): F1207 mosaic.cc:10] Check failed: x == y"


def test_extrapolate_is_proportional_or_the_line_through_two_points():
  assert report_lib.extrapolate([100], [512], 4096) == 800
  assert report_lib.extrapolate([100, 180], [256, 512], 4096) == 180 + 80 * (4096 - 512) / 256
  assert report_lib.extrapolate([100, 180], [256, 512], 256) == 100


@pytest.mark.aot
@pytest.mark.slow
def test_cycles_extrapolated_from_two_short_lengths_match_a_direct_compile():
  """What `aot` reports for T=2048 from compiles at 512 and 1024, against the
  estimate of a compile at 2048 itself.

  The Pallas kernels are a grid over chunks: linear in T to 2 %. XLA's glue
  is only near-linear (its fusion and tiling choices change with T: 14 %
  over the line at T=2048 here), so it is held to 20 %, not exempt: a cliff
  such as the guard's former q/k check had (4.5 k cycles at T=512, 108 k at
  2048, at Qwen3-Next heads) makes the extrapolated reports wrong.
  """
  shape = dict(b=1, t=0, hk=2, hv=4, k=128, v=128, dtype="bfloat16")
  results = aot.compile_in_child("v6e", "tokamax_gdn.aot.gated_delta_rule:cycle_cases",
                                 dict(shape=shape, lengths=[512, 1024, 2048], passes=["fwd"]))
  reports = [r.report for r in results]
  assert all(reports), results
  split = [report_lib.split_cycles(report_lib.GDN, r.kernel_cycles) for r in reports]
  for part, tolerance in (("gdn_fwd", 0.02), (report_lib.GLUE, 0.2)):
    short, longer, full = (s[part] for s in split)
    scaled = report_lib.extrapolate([short, longer], [512, 1024], 2048)
    assert scaled == pytest.approx(full, rel=tolerance), part


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
                 "--seq-len", "1024", "--cycle-lengths", "256", "--scaled-memory",
                 "--remat-policies", "save_gdn", "--json"])
  (report,) = json.loads(capsys.readouterr().out)
  assert rc == 0, report
  passes = {p["pass_"]: p for p in report["passes"]}
  assert set(passes) == {"fwd", "fwd+bwd", "fwd+bwd/save_gdn"}
  # libtpu's estimator aborts on some backward kernels (an LLO_CHECK): such a
  # pass says why and still gets its memory, from a compile at the full length.
  estimated = {k: p for k, p in passes.items() if p["total_cycles"] is not None}
  assert "fwd" in estimated, passes["fwd"]
  for p in passes.values():
    assert p["compiled"] == "ok" and p["argument_bytes"] > 0 and p["output_bytes"] > 0, p
    assert p["floor_cycles"] == max(p["mxu_cycles"], p["hbm_cycles"]) > 0
    if p["pass_"] not in estimated:   # memory from a compile at --seq-len
      assert p["memory_from"] == "T=1024", p
      assert p["note"].startswith("no cycle estimate: "), p
  for p in estimated.values():
    assert p["memory_from"] == "T=[256] scaled", p
    kernels = p["kernels"]
    assert report_lib.GLUE in kernels and any(n.startswith("gdn_") for n in kernels), kernels
    assert all(n.startswith("gdn_") for n in kernels if n != report_lib.GLUE), kernels
    assert p["total_cycles"] == sum(kernels.values()) > 0
    assert p["total_over_floor"] == pytest.approx(p["total_cycles"] / p["floor_cycles"])
  # The layer's arrays reach the forward kernel and leave it as they are
  # ([B, T, H D] q, k, v and output): no XLA relayout around it.
  assert estimated["fwd"]["kernels"][report_lib.GLUE] == 0, estimated["fwd"]["kernels"]
  if "fwd+bwd/save_gdn" in estimated:   # saved residuals: no states pass
    assert "gdn_fwd_states" not in estimated["fwd+bwd/save_gdn"]["kernels"]


def test_bundle_units_are_slot_shares_of_the_schedule(tmp_path):
  """Per unit: ops over (slots per bundle × bundles), from libtpu's
  per-bundle utilization file (its header spells "CAPACTIY")."""
  path = tmp_path / "1-k.1-70-final_hlo-static-per-bundle-utilization.txt"
  path.write_text("== CAPACTIY:\nMXU, XLU, VALU\n    2     2     4\n== UTILIZATION:\n"
                  "0 0 0\n2 1 4\n1 0 2\n1 1 0\n")
  units = aot.bundle_units(str(path))
  assert units == {"bundles": 4.0, "MXU": 4 / 8, "XLU": 2 / 8, "VALU": 6 / 16}


@pytest.mark.aot
def test_aot_units_give_each_kernels_slot_use(capsys):
  """`--units`: every Pallas kernel of each pass gets its schedule's length
  and its slot shares (a share is at most 1; the GDN kernels use the MXU)."""
  rc = cli.main(["aot", "--target", "v6e", "--hk", "1", "--hv", "2", "--k", "128", "--v", "128",
                 "--seq-len", "256", "--cycle-lengths", "256", "--scaled-memory", "--units",
                 "--json"])
  (report,) = json.loads(capsys.readouterr().out)
  assert rc == 0, report
  for p in report["passes"]:
    if p["total_cycles"] is None:    # libtpu's estimator aborted on this pass
      continue
    kernels = {n for n in p["kernels"] if n != report_lib.GLUE}
    assert set(p["units"]) == kernels, (p["units"], kernels)
    for u in p["units"].values():
      assert u["bundles"] > 0 and 0 < u["MXU"] <= 1 and 0 < u["VALU"] <= 1, u
      assert all(0 <= share <= 1 for name, share in u.items() if name != "bundles"), u


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


@pytest.mark.aot
def test_heads_over_one_tpu7x_chips_two_devices():
  """tpu7x: JAX exposes each of a chip's two TensorCores as a device. The
  layer's call with its heads split over the first two (one chip) by
  shard_map compiles, each device runs all three kernels on its half, with
  less memory (arguments, outputs and temporaries) than one device running
  every head."""
  mesh = aot.target_mesh("tpu7x", 2)
  assert len({tuple(d.coords) for d in mesh.devices.flat}) == 1   # one chip
  shape = dict(b=1, t=256, hk=2, hv=4, k=128, v=128, dtype="bfloat16")
  (label, fn, args), = report_lib.sharded_cases(mesh, shape, passes=["fwd+bwd"])
  half = aot.compile_for("tpu7x", fn, *args, mesh=mesh)
  (_, fn1, args1), = report_lib.sharded_cases(aot.target_mesh("tpu7x"), shape, ["fwd+bwd"])
  whole = aot.compile_for("tpu7x", fn1, *args1)
  assert half.pallas_calls == whole.pallas_calls == {name: 1 for name in KERNELS}, label
  footprint = lambda r: r.argument_bytes + r.output_bytes + r.temp_bytes
  assert footprint(half) < footprint(whole), (footprint(half), footprint(whole))
  # Qwen3-Next's heads at T=4096, 8 key heads per device: the backward at
  # C=128 fits tpu7x's 21 MiB of scoped VMEM by a few KiB (a branch more in
  # gdn_bwd once took it 2 KiB over, which the shape above did not show).
  (label, fn, args), = report_lib.sharded_cases(mesh, dict(shape, t=4096, hk=16, hv=32),
                                                passes=["fwd+bwd"])
  assert aot.compile_for("tpu7x", fn, *args, mesh=mesh).pallas_calls == half.pallas_calls


@pytest.mark.aot
def test_each_kernel_alone_has_a_tpu7x_cycle_estimate():
  """Where the whole step's estimate overflows tpu7x's VMEM (the cycle dump
  reserves VMEM of its own), each kernel compiled alone at a lower scoped
  limit gets one (the Qwen3-Next heads, all on one device)."""
  shape = dict(b=1, t=256, hk=16, hv=32, k=128, v=128, dtype="bfloat16")
  # As `aot`'s report takes them when the pass's own estimate fails.
  r = report_lib.PassReport(report_lib.GDN, "fwd+bwd", "ok", note="no cycle estimate")
  report_lib._kernels_alone(r, "tpu7x", shape, [256], 512, timeout=600)   # pylint: disable=protected-access
  assert list(r.kernels) == list(KERNELS), r.note
  assert all(c > 0 for c in r.kernels.values()), r.kernels
  assert r.total_cycles == sum(r.kernels.values())
  assert "glue not estimated" in r.note


@pytest.mark.aot
def test_each_kernel_has_a_v5e_cycle_estimate(tmp_path, monkeypatch):
  """v5e (no bf16 VPU): the kernels take the forms libtpu's estimator accepts
  there (`pallas_mosaic_tpu_kernel`, "v5e forms"; with the bf16 forms the
  estimate aborted the compile on an LLO type check), so each of the three
  has a cycle estimate. The child's cycle dump is removed afterwards (it
  used to stay in the temp folder, ~0.7 MiB per compile)."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
  monkeypatch.setenv("TMPDIR", str(tmp_path))     # the child's too
  shape = dict(b=1, t=256, hk=1, hv=2, k=128, v=128, dtype="bfloat16")
  results = aot.compile_in_child("v5e", "tokamax_gdn.aot.gated_delta_rule:kernel_cases",
                                 dict(shape=shape), timeout=600)
  assert not list(tmp_path.iterdir())
  assert [r.label.split()[0] for r in results] == list(KERNELS)
  for r in results:
    assert r.report is not None, (r.label, r.error)
    name = r.label.split()[0]
    assert [c for n, c in r.report.kernel_cycles.items() if aot.kernel_name(n) == name][0] > 0
