"""Runs a multi-device checks script in a subprocess and reports its checks.

The checks scripts of this folder (`sharding_checks.py`,
`context_parallel_checks.py`) need several host CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count=N must be set before jax
starts), which the other tests must not get; so each runs as
`python -P SCRIPT GROUP OUT.json [CHECK ...]` in a subprocess of its own, and
its test calls `check_group`.
"""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent


def _run(group, tmp_path_factory, script, host_devices=None, timeout=900, names=(),
         fast_compile=None):
  """Runs `script group OUT.json [names]` in a subprocess; (results, process).

  `host_devices` (default: 8 for the "cpu" group) CPU devices are forced for
  that subprocess only. `fast_compile` (default: when it runs on host
  devices) sets JAX_DISABLE_MOST_OPTIMIZATIONS: these checks compare results
  of tiny programs, where XLA's optimizations change nothing but the compile
  time (about half of it); AOT groups keep them, their memory numbers count.
  """
  out = tmp_path_factory.mktemp(f"{script.stem}_{group}") / "results.json"
  env = dict(os.environ, JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
             ALLOW_MULTIPLE_LIBTPU_LOAD="1")
  host_devices = host_devices or (8 if group == "cpu" else None)
  if host_devices:
    flags = env.get("XLA_FLAGS", "")
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={host_devices}".strip()
  if fast_compile if fast_compile is not None else bool(host_devices):
    env["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
  # -P: the script's folder (tests/) must not shadow installed packages
  # (a tests/flax/ would hide flax, which tokamax imports through qwix).
  proc = subprocess.run([sys.executable, "-P", str(script), group, str(out), *names], env=env,
                        capture_output=True, text=True, timeout=timeout, check=False)
  if not out.exists():
    pytest.fail(f"{script.name} {group} produced no results (rc {proc.returncode}):\n"
                f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
  return json.loads(out.read_text()), proc


def check_group(group, tmp_path_factory, script, names=None, **kwargs):
  """Runs every check of `group` (or `names`) in ONE subprocess and fails
  listing each check that failed or did not run.

  One test per group rather than one per check: a module-scoped fixture
  shared by per-check tests would run the subprocess again in every
  pytest-xdist worker that gets one of them, and a subprocess per check pays
  jax's import and the mesh setup each time. Each check's detail is printed
  (pytest -s or -rA shows them); "SKIP:" / "XFAIL:" details are reported,
  not failed.
  """
  names = list(names) if names is not None else [
      n for n, (g, _) in script_checks(script).items() if g == group]
  results, proc = _run(group, tmp_path_factory, script=script, names=names, **kwargs)
  bad = []
  for name in names:
    r = results.get(name)
    if r is None:
      bad.append(f"{name}: did not run (subprocess rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    elif not r["ok"]:
      bad.append(f"{name}:\n{r['detail']}")
    else:
      print(name, r["detail"], f"({r['seconds']} s)")
  assert not bad, "\n\n".join(bad)


def script_checks(script):
  """The CHECKS table of a checks script, loaded by path."""
  spec = importlib.util.spec_from_file_location(script.stem, script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.CHECKS
