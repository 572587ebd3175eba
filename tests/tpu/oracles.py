"""The named serving workloads' oracles, computed beside the tier by child
processes on the host's CPU.

The tier runs its tests in threads of one process (`ahead.py`); once their
compiles run side by side, its bound is the Python work of tracing and
lowering the programs, under one interpreter lock. The named workloads'
oracles (tokamax's reference and ours, and the inputs both take) are a large
share of that work, tokamax's verify-window reference most (a Python loop
over the requests and tokens). Children do it with interpreters of their own,
on the host's CPU,
in the order the tests want the cases, each case into a file (pickled numpy:
`test_base.compute_expected`'s inputs, tokamax's results, ours) that the tier
loads instead of computing it on the chip. Both references compute in float32
(ours and tokamax's plain one at HIGHEST precision; its verify-window one at
the platform's default, which on the CPU is float32 and on a TPU one bf16 pass
of each matmul). A case whose child failed or died is computed on the chip,
as without children, its error raised there in its test.

    python -m tests.tpu.oracles FOLDER NAME ...      (one child, JAX_PLATFORMS=cpu)
"""

import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

# A child's cases written and not taken yet, past which it waits (the files
# hold inputs and results, up to 1.6 GB a case) at most _BACKLOG_WAIT_S.
_BACKLOG = 6
_BACKLOG_WAIT_S = 120.0


def _path(folder: str, name: str, ext: str) -> str:
  return os.path.join(folder, f"{name}.{ext}")


def _write(folder: str, name: str, ext: str, dump) -> None:
  tmp = _path(folder, name, "tmp")
  with open(tmp, "wb") as f:
    dump(f)
  os.replace(tmp, _path(folder, name, ext))     # whole or absent


def _wait_for_room(folder: str, mine: list[str]) -> None:
  deadline = time.monotonic() + _BACKLOG_WAIT_S
  while (time.monotonic() < deadline
         and sum(os.path.exists(_path(folder, n, "pkl")) for n in mine) >= _BACKLOG):
    time.sleep(0.2)


def main(argv: list[str]) -> int:
  """A child: the cases `argv[1:]` in order, into folder `argv[0]`."""
  folder, names = argv[0], argv[1:]
  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
  from tests.ops.causal_conv1d_gated_delta_rule import test_base
  from tests.tpu import progress
  progress.listen_to_compiles()
  try:
    _compute(folder, names, arg_specs, test_base)
  finally:
    # Its compiles, for the runner's summary (`$TOKAMAX_GDN_TIER_LOG`).
    progress.write(dict(event="oracles", cases=len(names), **progress.take_compiles()))
  return 0


def _compute(folder, names, arg_specs, test_base) -> None:
  for name in names:
    _wait_for_room(folder, names)
    try:
      result = test_base.compute_expected(arg_specs.layout_of(name))
    except Exception:  # pylint: disable=broad-exception-caught
      message = traceback.format_exc().encode()
      _write(folder, name, "err", lambda f, m=message: f.write(m))
      continue
    _write(folder, name, "pkl", lambda f, r=result: pickle.dump(r, f, protocol=5))


class Children:
  """Child processes computing the cases `names` (split between them in
  turn, each in the order given); `take(name)` hands one over."""

  def __init__(self, names: list[str], processes: int):
    self._folder = tempfile.mkdtemp(prefix="tier-oracles-")
    self._owner = {}
    self._procs = []
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    for k in range(processes):
      mine = names[k::processes]
      if not mine:
        continue
      proc = subprocess.Popen([sys.executable, "-m", "tests.tpu.oracles", self._folder, *mine],
                              env=env)
      self._procs.append(proc)
      self._owner.update((n, proc) for n in mine)

  def take(self, name: str):
    """The case's (inputs, tokamax's results, ours), waiting for its child;
    None when no child has it, or its child failed on it or died."""
    proc = self._owner.get(name)
    if proc is None:
      return None
    pkl = _path(self._folder, name, "pkl")
    while True:
      exited = proc.poll() is not None
      if os.path.exists(pkl):
        with open(pkl, "rb") as f:
          result = pickle.load(f)
        os.remove(pkl)
        return result
      if exited or os.path.exists(_path(self._folder, name, "err")):
        return None
      time.sleep(0.05)

  def close(self, grace_s: float = 5.0) -> None:
    """Ends the children (those past their last case have a moment to write
    their compiles' line) and removes their files."""
    deadline = time.monotonic() + grace_s
    for proc in self._procs:
      try:
        proc.wait(max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    shutil.rmtree(self._folder, ignore_errors=True)


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
