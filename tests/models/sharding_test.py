"""The decoder sharded over a 2 x 4 ("data", "model") mesh of host devices
gives the unsharded logits and gradients (the shard_map mixers' psums and
their transposes are right). Runs `sharding_checks.py` in a subprocess with 8
host devices, which the other tests must not get."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parent / "sharding_checks.py"
ROOT = SCRIPT.parent.parent.parent


@pytest.fixture(scope="module")
def results():
  # Without XLA's optimisation pipeline, as in the pytest process
  # (tests/conftest.py): half the compile time, the same numbers to 2e-5.
  env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "")
                        + " --xla_force_host_platform_device_count=8").strip(),
             PYTHONPATH=str(ROOT))
  proc = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                        timeout=900, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULTS "):
      return json.loads(line[len("RESULTS "):])
  pytest.fail(f"sharding_checks.py gave no results (rc {proc.returncode}):\n{proc.stderr[-4000:]}")


@pytest.mark.parametrize("name", ["forward_and_grads", "generate_with_params_on_a_mesh"])
def test_sharded_decoder_matches_unsharded(results, name):
  assert results[name] == "ok", results[name]
