"""Test configuration: CPU only, no network lookups from libtpu, and libtpu
loadable by several processes at once (pytest-xdist workers each compile for
TPU targets ahead of time).

`pytest -m tpu` (the on-chip tier, tests/tpu/) is the exception: it runs on
the TPU the process finds, with XLA's full optimisation pipeline.
"""

import gc
import json
import os
import subprocess
import sys
import tempfile


def _tpu_tier(argv) -> bool:
  """Whether the command selects the `tpu` marker (`-m tpu`, `-m "tpu and ..."`)."""
  for i, arg in enumerate(argv):
    expr = argv[i + 1] if arg == "-m" and i + 1 < len(argv) else (
        arg[2:] if arg.startswith("-m") and len(arg) > 2 else None)
    if expr is not None and "tpu" in expr.replace("not tpu", ""):
      return True
  return False


TPU_TIER = _tpu_tier(sys.argv)
if not TPU_TIER:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # pylint: disable=g-import-not-at-top,wrong-import-position
import pytest  # pylint: disable=g-import-not-at-top,wrong-import-position

from tokamax_gdn import config  # pylint: disable=g-import-not-at-top,wrong-import-position

# XLA:CPU compiles dominate the suite's time; without the optimisation
# pipeline they take about half as long (measured: the xla GDN tests, 446 ->
# 240 CPU-s) and every numerical comparison still holds. Compiles for TPU
# targets (tests marked `aot`: memory and cycle estimates are what they
# check) keep the full pipeline.
if not TPU_TIER:
  jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  """Drops JAX's caches of compiled executables after each test module.

  Each XLA:CPU executable keeps its JIT-compiled code in three memory
  mappings (code, read-only data, data) for as long as a jit cache holds it.
  A pytest-xdist worker compiles thousands of programs, and the kernel caps a
  process at `vm.max_map_count` (65530) mappings: past it, the next compile's
  mmap fails and XLA:CPU segfaults (the "worker crashed" in
  `backend_compile_and_load` that struck unrelated tests in ~1 run of 3).
  Measured (`pytest -n 2` without this, both workers sampled every 15 s):
  one worker peaked at 61.1 k mappings; at 31.0 k, 10.4 k each were
  anonymous r-x, r-- and rw- ones. Clearing drops them (tests/ops/gmm and
  tgmm in one process: 2894 -> 783).
  """
  yield
  jax.clear_caches()
  gc.collect()


@pytest.fixture(autouse=True)
def _full_optimizations_for_tpu_compiles(request):
  if TPU_TIER or request.node.get_closest_marker("aot") is None:
    yield
    return
  jax.config.update("jax_disable_most_optimizations", False)
  try:
    yield
  finally:
    jax.config.update("jax_disable_most_optimizations", True)


@pytest.fixture(params=["v5e", "v6e", "v5p", "tpu7x"])
def target_chip(request):
  """Each TPU generation in turn as the one the tiling heuristics target."""
  config.set_target_chip(request.param)
  try:
    yield request.param
  finally:
    config.set_target_chip(None)


# Tests known to run for minutes (TPU compiles, multi-device subprocess
# groups, training runs) go first: a long test collected last would run
# alone at the end while the other worker idles. The README's command runs
# `pytest -n 2 --dist worksteal`: each worker starts on its half of the
# collection and a worker that runs out takes half of the other's remaining
# tests, so the end is short tests on both (under the default "load" mode a
# worker's queued tests stay with it).
_LONG_FILES = ("tests/context_parallel_test.py", "tests/sharding_test.py",
               "tests/models/sharding_test.py", "tests/training/", "tests/cli/",
               "tests/docs_test.py::test_every_python_block_runs_as_written")


def _runs_long(item) -> bool:
  return (item.get_closest_marker("aot") is not None
          or item.get_closest_marker("slow") is not None
          or item.nodeid.startswith(_LONG_FILES))


def pytest_collection_modifyitems(items):
  """Long tests first; tests marked `tpu` skip, with the reason, without a TPU chip."""
  items.sort(key=lambda item: not _runs_long(item))   # stable: order kept within each group
  if any(item.get_closest_marker("tpu") for item in items):
    if jax.devices()[0].platform != "tpu":
      skip = pytest.mark.skip(reason="needs a TPU chip: run `pytest -m tpu` on a TPU VM")
      for item in items:
        if item.get_closest_marker("tpu"):
          item.add_marker(skip)


# Tests marked `aot` load libtpu to compile for TPU generations. libtpu beside
# XLA:CPU in one process aborted a pytest-xdist worker once ("Fatal Python
# error: Aborted" in a later XLA:CPU compile of another test), so they run in
# a child process (`tests/aot_child.py`): a crash there fails that test, not
# the run. One child serves a worker's aot tests in turn (a child per test
# cost ~6 s each to start); a crashed one is replaced for the next test, and
# one past _AOT_CHILD_MAX_RSS is replaced before it.
_AOT_CHILD = "TOKAMAX_GDN_AOT_CHILD"
_AOT_CHILD_MAX_RSS = 8 << 30
_aot_child = None


def _rss_bytes(pid):
  try:
    with open(f"/proc/{pid}/status") as f:
      return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))
  except (OSError, StopIteration, ValueError):
    return 0


def _stop_aot_child():
  global _aot_child
  if _aot_child is not None:
    _aot_child.stdin.close()
    try:
      _aot_child.wait(timeout=60)
    except subprocess.TimeoutExpired:
      _aot_child.kill()
      _aot_child.wait()
    _aot_child = None


def _run_in_aot_child(nodeid, rootpath, log_path):
  """(exit code or None if the child died, the test's output) of `nodeid` run in the child."""
  global _aot_child
  if _aot_child is not None and (_aot_child.poll() is not None
                                 or _rss_bytes(_aot_child.pid) > _AOT_CHILD_MAX_RSS):
    _stop_aot_child()
  if _aot_child is None:
    _aot_child = subprocess.Popen(
        [sys.executable, "-m", "tests.aot_child"], cwd=str(rootpath), text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=dict(os.environ, **{_AOT_CHILD: "1"}))
  try:
    _aot_child.stdin.write(json.dumps(dict(nodeid=nodeid, log=str(log_path))) + "\n")
    _aot_child.stdin.flush()
    reply = _aot_child.stdout.readline()
  except BrokenPipeError:
    reply = ""
  out = ""
  if os.path.exists(log_path):
    with open(log_path, errors="replace") as f:
      out = f.read()
  if reply:
    return json.loads(reply)["rc"], out
  rc = _aot_child.wait()
  _aot_child = None
  return None, out + f"\n[the aot child process died: exit code {rc}]"


def pytest_sessionfinish(session):  # pylint: disable=unused-argument
  _stop_aot_child()


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
  if (os.environ.get(_AOT_CHILD) or TPU_TIER
      or pyfuncitem.get_closest_marker("aot") is None):
    return None
  with tempfile.TemporaryDirectory(prefix="aot_child_") as tmp:
    rc, out = _run_in_aot_child(pyfuncitem.nodeid, pyfuncitem.config.rootpath,
                                os.path.join(tmp, "out.txt"))
  tail = out[-4000:]
  if rc == 0 and " passed" in out:
    return True
  if rc == 0 and " skipped" in out:
    pytest.skip(f"skipped in its child process: {tail[-500:]}")
  pytest.fail(f"{pyfuncitem.nodeid} in a child process (exit {rc}):\n{tail}", pytrace=False)
