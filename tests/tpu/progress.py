"""pytest plugin of the tier runner (`tests/tpu/runner.py`): one JSON line per
test start and per test result, appended to the file `$TOKAMAX_GDN_TIER_LOG`
and flushed at once, so that the runner sees which test is running when a
process stalls or dies, and what every finished one gave.

Lines: {"event": "start", "id": ...} when a test begins; {"event": "end",
"id", "outcome" (passed / failed / skipped), "seconds", "message"} when its
result is known (a failing setup or teardown counts as the test's failure).
"""

import json
import os
import time

ENV = "TOKAMAX_GDN_TIER_LOG"


def _write(line: dict) -> None:
  path = os.environ.get(ENV)
  if not path:
    return
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")
    f.flush()


def pytest_runtest_logstart(nodeid, location):
  del location
  _write(dict(event="start", id=nodeid, time=time.time()))


def pytest_runtest_logreport(report):
  # The call phase gives the result; setup and teardown only when they fail
  # (or skip, in setup: a skip marker or a fixture's skip).
  if report.when == "call" or (report.when != "call" and report.outcome == "failed") or (
      report.when == "setup" and report.outcome == "skipped"):
    message = ""
    if report.outcome != "passed":
      message = str(report.longrepr)[-2000:]
    _write(dict(event="end", id=report.nodeid, outcome=report.outcome,
                seconds=round(report.duration, 2), when=report.when, message=message))
