"""pytest plugin of the tier runner (`tests/tpu/runner.py`): one JSON line per
test start and per test result, appended to the file `$TOKAMAX_GDN_TIER_LOG`
and flushed at once, so that the runner sees which test is running when a
process stalls or dies, and what every finished one gave.

Lines: {"event": "start", "id": ...} when a test begins; {"event": "end",
"id", "outcome" (passed / failed / skipped), "seconds", "message"} when its
result is known (a failing setup or teardown counts as the test's failure),
with "compile_s" / "lower_s" / "compiles": the seconds the test spent in XLA
compiles and in tracing and lowering, and how many compiles (jax's monitoring
events), to tell compile time from run time on the chip; "slowest": its
three longest compiles, [function name, seconds].

`$TOKAMAX_GDN_TIER_FIRST` (substrings joined by newlines) runs the tests whose
ids contain one of them first, in that order, the rest after in collection
order: a short device session reaches what matters most.
"""

import collections
import json
import os
import time

ENV = "TOKAMAX_GDN_TIER_LOG"
FIRST_ENV = "TOKAMAX_GDN_TIER_FIRST"
# "0": on_chip_test computes no oracles ahead in threads (the runner sets it
# after a crash, so that a crash is charged to the test that caused it).
AHEAD_ENV = "TOKAMAX_GDN_TIER_AHEAD"


_LOWER_S = collections.Counter()
_COMPILES: list[tuple[float, str]] = []     # (seconds, function name) of the test's compiles


def pytest_configure(config):
  """Listens to jax's compile events, in the pytest process that loads this
  plugin only (the runner imports this module for its constants, jax-free)."""
  del config
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  from jax._src import dispatch  # pylint: disable=g-import-not-at-top

  def on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == dispatch.BACKEND_COMPILE_EVENT:
      _COMPILES.append((seconds, str(kwargs.get("fun_name", "?"))))
    elif event in (dispatch.JAXPR_TRACE_EVENT, dispatch.JAXPR_TO_MLIR_MODULE_EVENT):
      _LOWER_S["s"] += seconds

  monitoring.register_event_duration_secs_listener(on_duration)


def first_rank(test_id: str, first: list[str]) -> int:
  """The index of the first of `first` that `test_id` contains; len(first) if none."""
  return next((n for n, sub in enumerate(first) if sub in test_id), len(first))


def pytest_collection_modifyitems(session, config, items):
  del session, config
  first = [s for s in os.environ.get(FIRST_ENV, "").split("\n") if s]
  if first:
    items.sort(key=lambda item: first_rank(item.nodeid, first))  # stable: collection order within


def _write(line: dict) -> None:
  path = os.environ.get(ENV)
  if not path:
    return
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")
    f.flush()


def pytest_runtest_logstart(nodeid, location):
  del location
  _LOWER_S.clear()
  _COMPILES.clear()
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
                seconds=round(report.duration, 2), when=report.when, message=message,
                compile_s=round(sum(sec for sec, _ in _COMPILES), 2),
                lower_s=round(_LOWER_S["s"], 2), compiles=len(_COMPILES),
                slowest=[[name, round(sec, 2)] for sec, name in sorted(_COMPILES)[::-1][:3]]))
