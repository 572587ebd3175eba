"""The child process that runs the tests marked `aot` for a pytest worker.

`tests/conftest.py` runs each `aot` test here, not in the worker: libtpu
beside XLA:CPU in one process aborted a worker once, and a crash here fails
the test that ran, not the run. One child serves many tests (a fresh one per
test cost about 6 s each in starting Python, jax, pytest, the test module and
libtpu: tests/ops/gmm/aot_test.py took 123 s that way, 42 s in one process),
and the worker starts a new one after a crash.

Protocol (`python -m tests.aot_child`, repository root as the working
folder): one JSON request per line on stdin, {"nodeid": ..., "log": PATH};
the test runs as `pytest -q -rs NODEID` in this process with its output
(file descriptors 1 and 2) in PATH, then one JSON line {"rc": exit code} on
the original stdout. End of stdin: exit.
"""

import json
import os
import sys


def serve() -> None:
  proto = os.fdopen(os.dup(1), "w")
  saved = os.dup(1), os.dup(2)
  import pytest  # pylint: disable=g-import-not-at-top
  for line in sys.stdin:
    request = json.loads(line)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(request["log"], "w") as log:
      os.dup2(log.fileno(), 1)
      os.dup2(log.fileno(), 2)
      try:
        rc = int(pytest.main(["-q", "-p", "no:xdist", "-p", "no:cacheprovider", "-rs",
                              request["nodeid"]]))
      finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
    proto.write(json.dumps(dict(rc=rc)) + "\n")
    proto.flush()


if __name__ == "__main__":
  serve()
