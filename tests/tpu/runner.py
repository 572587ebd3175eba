"""Runs the on-chip tier so that no test can stall or take down the others,
and so that a run cut short can go on where it stopped.

    python -m tests.tpu.runner --out DIR [--budget-s S] [--test-timeout-s S]
                               [--rerun-failed] [--first SUBSTRING ...] [-- PYTEST ARGS]

PYTEST ARGS default to the tier (`-m tpu -p no:xdist tests/tpu`); add `-k` to
pick a part. The runner collects the test ids, then runs one pytest process
(the chip takes one holder) over those without a result in DIR/results.jsonl,
watching each test as it starts and ends (`tests/tpu/progress.py`):

- a test that runs past --test-timeout-s (a compile that stalls) is recorded
  as `timeout`, its process is killed, and a new process goes on with the
  next test;
- a process that dies in a test (a crash in the runtime) records that test
  as `crashed`, with the process's last output, and the next process goes on
  (without the oracles computed ahead in threads: a crash there would be
  charged to another test);
- at --budget-s the run stops, the test in progress killed: it and the rest
  are listed as not run, and the same command with the same DIR runs them
  later (a TPU session's device time is short, one call's shorter still,
  and the tier takes longer than either).

Exit status 0 only when every collected test ran and none failed, timed out
or crashed. DIR/summary.json holds the counts and the problems.
"""

import argparse
import collections
import json
import os
import signal
import subprocess
import sys
import time

from tests.tpu import progress

DEFAULT_PYTEST_ARGS = ["-m", "tpu", "-p", "no:xdist", "tests/tpu"]
_BAD = ("failed", "timeout", "crashed")


def _pytest(args, **kw):
  return subprocess.Popen([sys.executable, "-m", "pytest", *args], **kw)


def collect(pytest_args) -> list[str]:
  """The test ids the pytest args select, in pytest's order."""
  proc = _pytest(["--collect-only", "-q", *pytest_args], stdout=subprocess.PIPE,
                 stderr=subprocess.STDOUT, text=True)
  out, _ = proc.communicate()
  ids = [line.strip() for line in out.splitlines() if "::" in line and " " not in line.strip()]
  if proc.returncode not in (0, 5) or (not ids and proc.returncode != 5):
    raise RuntimeError(f"collecting the tests failed (exit {proc.returncode}):\n{out[-3000:]}")
  return ids


def read_results(path: str) -> dict[str, dict]:
  """id -> its recorded result (the worst of its lines: a failing teardown
  after a passing call is a failure)."""
  rank = dict(passed=0, skipped=0, failed=2, timeout=3, crashed=3)
  results = {}
  if not os.path.exists(path):
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


def _append(path: str, line: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")


def _kill(proc) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def _watch(proc, results_path: str, offset: int, test_timeout_s: float, deadline: float,
           poll_s: float, log) -> tuple[str, str | None, float]:
  """Follows one pytest process through the results file until it exits, a
  test runs past the timeout, or the deadline passes (then it is killed).
  Returns (how it ended: "exited" / "timeout" / "deadline", the test running
  then or None, how long it had run)."""
  current, since, started = None, time.time(), False
  while True:
    code = proc.poll()
    with open(results_path) as f:
      f.seek(offset)
      chunk = f.read()
    whole = chunk[:chunk.rfind("\n") + 1]      # the plugin may be mid-line
    offset += len(whole.encode())
    for line in whole.splitlines():
      r = json.loads(line)
      if r["event"] == "start":
        current, since, started = r["id"], time.time(), True
      elif r["event"] == "end" and r["id"] == current:
        slowest = ", ".join(f"{name} {sec:.1f}" for name, sec in r.get("slowest", []))
        spent = (f" (compiles {r['compile_s']:.1f} s / {r['compiles']}, lowering"
                 f" {r['lower_s']:.1f} s; slowest: {slowest or '-'})" if "compile_s" in r else "")
        log(f"[tier] {r['outcome']:8s} {r['seconds']:7.1f} s  {r['id']}{spent}")
        current = None
    if code is not None:
      return ("exited" if started or current else "no_test"), current, time.time() - since
    if current is not None and time.time() - since > test_timeout_s:
      _kill(proc)
      return "timeout", current, time.time() - since
    if time.time() > deadline:
      _kill(proc)
      return "deadline", current, time.time() - since
    time.sleep(poll_s)


def run(out_dir: str, pytest_args, *, budget_s: float = 540.0, test_timeout_s: float = 300.0,
        rerun_failed: bool = False, first: list[str] | None = None, poll_s: float = 0.5,
        log=print) -> dict:
  """Runs the selected tests (see the module docstring); returns the summary.
  `first`: substrings of test ids to run before the others, in that order."""
  start = time.time()
  os.makedirs(out_dir, exist_ok=True)
  results_path = os.path.join(out_dir, "results.jsonl")
  log_path = os.path.join(out_dir, "pytest.log")
  first = list(first or [])
  ids = sorted(collect(pytest_args), key=lambda i: progress.first_rank(i, first))
  if rerun_failed:
    kept = [r for r in read_results(results_path).values() if r["outcome"] not in _BAD]
    with open(results_path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
  open(results_path, "a").close()
  env = dict(os.environ, **{progress.ENV: results_path, progress.FIRST_ENV: "\n".join(first)})
  while True:
    done = read_results(results_path)
    todo = [i for i in ids if i not in done]
    if not todo:
      break
    if time.time() - start > budget_s:
      log(f"[tier] budget of {budget_s:.0f} s spent: {len(todo)} test(s) not run")
      break
    log(f"[tier] starting pytest on {len(todo)} test(s)")
    # The same selection (the `-m tpu` also tells tests/conftest.py to keep
    # the chip), less what already has a result.
    deselect = [a for i in ids if i in done for a in ("--deselect", i)]
    with open(log_path, "a") as out:
      proc = _pytest([*pytest_args, "-p", "tests.tpu.progress", "-q", *deselect], stdout=out,
                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
    how, current, seconds = _watch(proc, results_path, os.path.getsize(results_path),
                                   test_timeout_s, start + budget_s, poll_s, log)
    if how == "no_test":
      tail = open(log_path).read()[-1500:]
      log(f"[tier] pytest exited with {proc.returncode} without running a test:\n{tail}")
      break
    if current is None:
      continue
    outcome = {"exited": "crashed", "timeout": "timeout"}.get(how)
    if outcome is None:       # the deadline: the test stays not run
      log(f"[tier] budget spent while {current} ran: stopped")
      break
    message = (f"no result after {test_timeout_s:.0f} s: killed" if outcome == "timeout" else
               f"pytest exited with {proc.returncode} in this test:\n"
               + open(log_path).read()[-2000:])
    _append(results_path, dict(event="end", id=current, outcome=outcome,
                               seconds=round(seconds, 1), when="call", message=message))
    log(f"[tier] {outcome:8s} {seconds:7.1f} s  {current}")
    if outcome == "crashed":
      # The oracles computed ahead run in threads beside the test: a crash in
      # one of them would be charged to whichever test ran. From here on each
      # test computes its own, so a crash names its test.
      env[progress.AHEAD_ENV] = "0"
  done = read_results(results_path)
  counts = collections.Counter(done[i]["outcome"] for i in ids if i in done)
  not_run = [i for i in ids if i not in done]
  problems = {i: done[i]["message"][-600:] for i in ids
              if i in done and done[i]["outcome"] in _BAD}
  summary = dict(collected=len(ids), counts=dict(counts), not_run=not_run, problems=problems,
                 seconds=round(time.time() - start, 1))
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  log(f"[tier] {len(ids)} collected: " + ", ".join(f"{n} {k}" for k, n in counts.items())
      + f", {len(not_run)} not run ({summary['seconds']:.0f} s)")
  for i, msg in problems.items():
    log(f"[tier] {done[i]['outcome'].upper()} {i}\n{msg}\n")
  return summary


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  pytest_args = DEFAULT_PYTEST_ARGS
  if "--" in argv:
    cut = argv.index("--")
    argv, pytest_args = argv[:cut], argv[cut + 1:]
  parser = argparse.ArgumentParser(prog="python -m tests.tpu.runner", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", required=True, help="results folder (resumed when it exists)")
  parser.add_argument("--budget-s", type=float, default=540.0,
                      help="stop after this many seconds (what has not finished is not run)")
  parser.add_argument("--test-timeout-s", type=float, default=300.0,
                      help="a test running longer is killed and recorded as a timeout")
  parser.add_argument("--rerun-failed", action="store_true",
                      help="run the failed, timed-out and crashed tests of DIR again")
  parser.add_argument("--first", action="append", metavar="SUBSTRING",
                      help="run the tests whose ids contain it before the others (repeatable,"
                      " in the order given)")
  args = parser.parse_args(argv)
  summary = run(args.out, pytest_args, budget_s=args.budget_s,
                test_timeout_s=args.test_timeout_s, rerun_failed=args.rerun_failed,
                first=args.first)
  bad = sum(summary["counts"].get(k, 0) for k in _BAD)
  return 0 if not bad and not summary["not_run"] else 1


if __name__ == "__main__":
  sys.exit(main())
