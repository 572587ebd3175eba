"""Sharded GDN / causal_conv1d / gmm give the unsharded results, and sharded
GDN forward+backward compiles for tpu7x 2x2x1 (8 TensorCores).

The checks live in `sharding_checks.py` and run in subprocesses: the CPU ones
need 8 host devices (XLA_FLAGS=--xla_force_host_platform_device_count=8 must be
set before jax starts), which the other tests must not get.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
SCRIPT = HERE / "sharding_checks.py"

_spec = importlib.util.spec_from_file_location("sharding_checks", SCRIPT)
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


def _run(group, tmp_path_factory, script=SCRIPT, host_devices=None, timeout=900, names=()):
  """Runs `script group OUT.json [names]` in a subprocess; (results, process).

  `host_devices` (default: 8 for the "cpu" group) CPU devices are forced for
  that subprocess only.
  """
  out = tmp_path_factory.mktemp(f"{script.stem}_{group}") / "results.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  host_devices = host_devices or (8 if group == "cpu" else None)
  if host_devices:
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
  # -P: the script's folder (tests/) must not shadow installed packages
  # (tests/flax/ would hide flax, which tokamax imports through qwix).
  proc = subprocess.run([sys.executable, "-P", str(script), group, str(out), *names], env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)
  if not out.exists():
    pytest.fail(f"{script.name} {group} produced no results (rc {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  return json.loads(out.read_text()), proc


@pytest.fixture(scope="module")
def cpu_results(tmp_path_factory):
  return _run("cpu", tmp_path_factory)


@pytest.fixture(scope="module")
def aot_results(tmp_path_factory):
  return _run("aot", tmp_path_factory)


def _names(group):
  return [n for n, (g, _) in checks.CHECKS.items() if g == group]


def _assert(results, name):
  results, proc = results
  if name not in results:
    pytest.fail(f"{name} did not run (subprocess rc {proc.returncode}):\n{proc.stderr[-4000:]}")
  r = results[name]
  if r["ok"] and str(r["detail"]).startswith("SKIP:"):
    pytest.skip(r["detail"][5:].strip())
  if r["ok"] and str(r["detail"]).startswith("XFAIL:"):
    pytest.xfail(r["detail"][6:].strip())
  assert r["ok"], r["detail"]
  print(name, r["detail"], f"({r['seconds']} s)")


@pytest.mark.parametrize("name", _names("cpu"))
def test_sharded_matches_unsharded(cpu_results, name):
  _assert(cpu_results, name)


@pytest.mark.parametrize("name", _names("aot"))
def test_aot_tpu7x_8_devices(aot_results, name):
  _assert(aot_results, name)
