"""pytest plugin of the tier runner (`tests/tpu/runner.py`): one JSON line per
test start and per test result, appended to the file `$TOKAMAX_GDN_TIER_LOG`
and flushed at once, so that the runner sees which test is running when a
process stalls or dies, and what every finished one gave.

Lines: {"event": "start", "id": ...} when a test begins; {"event": "end",
"id", "outcome" (passed / failed / skipped), "seconds", "message"} when its
result is known (a failing setup or teardown counts as the test's failure),
with the compiles since the previous line (jax's monitoring events): in
pytest's own thread "compile_s" / "lower_s" / "compiles" (seconds in XLA
compiles, in tracing and lowering, how many compiles) and in the threads
that run tests ahead (`tests/tpu/ahead.py`) "ahead_compile_s" /
"ahead_lower_s" / "ahead_compiles"; "slowest": the three longest compiles,
[function name, seconds]; "ahead": how long the test ran ahead, where it
did. When the session ends, {"event": "session"} carries the compiles after
the last test's line. Summed over a run's lines: all its compiles. The child
processes computing oracles on the CPU (`oracles.py`) each add a line
{"event": "oracles"} with theirs.

`$TOKAMAX_GDN_TIER_FIRST` (substrings joined by newlines) runs the tests whose
ids contain one of them first, in that order, the rest after in collection
order: a short device session reaches what matters most.
"""

import json
import os
import threading
import time

import pytest

from tests.tpu import ahead

ENV = "TOKAMAX_GDN_TIER_LOG"
FIRST_ENV = "TOKAMAX_GDN_TIER_FIRST"
# "0": the tests run one at a time in pytest's thread (the runner sets it
# after a crash, so that a crash is charged to the test that caused it).
AHEAD_ENV = ahead.ENV

# (seconds, function name, pytest's own thread?) of each compile, and the
# seconds of tracing and lowering (kind "lower"), since the last line written.
_EVENTS: list[tuple[str, float, str, bool]] = []
_LOCK = threading.Lock()


def pytest_configure(config):
  """Listens to jax's compile events, in the pytest process that loads this
  plugin only (the runner imports this module for its constants, jax-free)."""
  del config
  listen_to_compiles()


def listen_to_compiles() -> None:
  """Collects this process's compiles for `take_compiles` from now on."""
  from jax import monitoring  # pylint: disable=g-import-not-at-top
  from jax._src import dispatch  # pylint: disable=g-import-not-at-top

  def on_duration(event: str, seconds: float, **kwargs) -> None:
    if event == dispatch.BACKEND_COMPILE_EVENT:
      kind = "compile"
    elif event in (dispatch.JAXPR_TRACE_EVENT, dispatch.JAXPR_TO_MLIR_MODULE_EVENT):
      kind = "lower"
    else:
      return
    here = threading.current_thread() is threading.main_thread()
    with _LOCK:
      _EVENTS.append((kind, seconds, str(kwargs.get("fun_name", "?")), here))

  monitoring.register_event_duration_secs_listener(on_duration)


def first_rank(test_id: str, first: list[str]) -> int:
  """The index of the first of `first` that `test_id` contains; len(first) if none."""
  return next((n for n, sub in enumerate(first) if sub in test_id), len(first))


def read_results(path: str) -> dict[str, dict]:
  """id -> its recorded result (the worst of its lines: a failing teardown
  after a passing call is a failure)."""
  rank = dict(passed=0, skipped=0, failed=2, timeout=3, crashed=3)
  results = {}
  if not path or not os.path.exists(path):
    return results
  with open(path) as f:
    for line in f:
      try:
        r = json.loads(line)
      except json.JSONDecodeError:
        continue      # a line cut off by a kill
      if r.get("event") != "end":
        continue
      old = results.get(r["id"])
      if old is None or rank.get(r["outcome"], 1) >= rank.get(old["outcome"], 1):
        results[r["id"]] = r
  return results


@pytest.hookimpl(trylast=True)     # after -m / -k and tests/conftest.py's order
def pytest_collection_modifyitems(session, config, items):
  """`$TOKAMAX_GDN_TIER_FIRST`'s order; the selected ids go to the log (the
  runner's list of the run), then the tests that already have a result there
  are left out (a resumed run runs the rest)."""
  del session
  first = [s for s in os.environ.get(FIRST_ENV, "").split("\n") if s]
  if first:
    items.sort(key=lambda item: first_rank(item.nodeid, first))  # stable: collection order within
  write(dict(event="collected", ids=[item.nodeid for item in items]))
  done = read_results(os.environ.get(ENV, ""))
  if done:
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid in done])
    items[:] = [item for item in items if item.nodeid not in done]


def write(line: dict) -> None:
  path = os.environ.get(ENV)
  if not path:
    return
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")
    f.flush()


def take_compiles() -> dict:
  """The compile fields of a line, from the events since the last one (taken)."""
  with _LOCK:
    events = list(_EVENTS)
    _EVENTS.clear()
  out = {}
  for prefix, here in (("", True), ("ahead_", False)):
    compiles = [(sec, name) for kind, sec, name, h in events if kind == "compile" and h == here]
    out[prefix + "compile_s"] = round(sum(sec for sec, _ in compiles), 2)
    out[prefix + "compiles"] = len(compiles)
    out[prefix + "lower_s"] = round(
        sum(sec for kind, sec, _, h in events if kind == "lower" and h == here), 2)
  slowest = sorted((sec, name) for kind, sec, name, _ in events if kind == "compile")[::-1][:3]
  out["slowest"] = [[name, round(sec, 2)] for sec, name in slowest]
  return out


def pytest_runtest_logstart(nodeid, location):
  del location
  write(dict(event="start", id=nodeid, time=time.time()))


def pytest_runtest_logreport(report):
  # The call phase gives the result; setup and teardown only when they fail
  # (or skip, in setup: a skip marker or a fixture's skip).
  if report.when == "call" or (report.when != "call" and report.outcome == "failed") or (
      report.when == "setup" and report.outcome == "skipped"):
    message = ""
    if report.outcome != "passed":
      message = str(report.longrepr)[-2000:]
    line = dict(event="end", id=report.nodeid, outcome=report.outcome,
                seconds=round(report.duration, 2), when=report.when, message=message,
                **take_compiles())
    ran_ahead = dict(report.user_properties).get("ahead")
    if ran_ahead:
      line["ahead"] = ran_ahead
    write(line)


def pytest_sessionfinish(session, exitstatus):
  del session, exitstatus
  write(dict(event="session", **take_compiles()))
