"""Runs the on-chip tier so that no test can stall or take down the others,
and so that a run cut short can go on where it stopped.

    python -m tests.tpu.runner --out DIR [--budget-s S] [--test-timeout-s S]
                               [--rerun-failed] [--first SUBSTRING ...]
                               [--compile-cache DIR2] [-- PYTEST ARGS]

PYTEST ARGS default to the tier (`-m tpu -p no:xdist tests/tpu`); add `-k` to
pick a part. The runner runs one pytest process (the chip takes one holder)
over the selected tests without a result in DIR/results.jsonl (the process
lists what it selected there: no separate collection, which would open the
chip once more), watching each test as it starts and ends
(`tests/tpu/progress.py`):

- a test that runs past --test-timeout-s (a compile that stalls) is recorded
  as `timeout`, its process is killed, and a new process goes on with the
  next test;
- a process that dies in a test (a crash in the runtime) records that test
  as `crashed`, with the process's last output, and the next process goes on
  (running the tests one at a time, not ahead in threads: a crash there
  would be charged to another test);
- at --budget-s the run stops, the test in progress killed: it and the rest
  are listed as not run, and the same command with the same DIR runs them
  later.

In the pytest process the tests' bodies run side by side in threads, ahead
of pytest's own order (`tests/tpu/ahead.py`): the tier is compile-bound and
the chip host has cores to compile on; child processes compute the named
serving workloads' oracles on the host's CPU (`tests/tpu/oracles.py`,
`$TOKAMAX_GDN_TIER_ORACLE_PROCESSES`, default 2, 0 for none). `--compile-cache DIR2` also keeps the
compiled programs in jax's persistent cache in DIR2 (a resumed or repeated
run on the same machine compiles only what changed).

Exit status 0 only when every collected test ran and none failed, timed out
or crashed. The closing lines and DIR/summary.json give the counts, the
problems, what was left not run, and the compiling: programs compiled, their
seconds summed over the threads that compiled them (more than the wall time
when threads compile side by side) and the seconds of tracing and lowering
(Python, one thread at a time: near the wall time, it is the bound), and the
same for the oracle processes.
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


read_results = progress.read_results


def _collected(path: str, offset: int) -> list[str] | None:
  """The test ids the pytest process that wrote from `offset` selected (in
  its order), or None when it wrote none (collection failed)."""
  ids = None
  for r in _lines_from(path, offset):
    if r.get("event") == "collected":
      ids = r["ids"]
  return ids


def _append(path: str, line: dict) -> None:
  with open(path, "a") as f:
    f.write(json.dumps(line) + "\n")


def _kill(proc) -> None:
  try:
    os.killpg(proc.pid, signal.SIGKILL)
  except ProcessLookupError:
    pass
  proc.wait()


def _compiles(r: dict) -> str:
  """A result line's compiles, for the log."""
  if "compile_s" not in r:
    return ""
  slowest = ", ".join(f"{name} {sec:.1f}" for name, sec in r.get("slowest", []))
  ran = r.get("ahead")
  where = f"ran ahead {ran['seconds']:.1f} s; " if ran else ""
  return (f" ({where}compiles here {r['compile_s']:.1f} s / {r['compiles']}, ahead"
          f" {r.get('ahead_compile_s', 0):.1f} s / {r.get('ahead_compiles', 0)}; lowering"
          f" {r['lower_s'] + r.get('ahead_lower_s', 0):.1f} s; slowest: {slowest or '-'})")


def compile_totals(lines) -> dict:
  """The compiling of a run, from its lines (`progress`): programs compiled,
  seconds summed over threads, of them in pytest's thread, tracing and
  lowering; and in "oracles" the same of the child processes that computed
  oracles on the CPU (`oracles.py`)."""
  total = dict(programs=0, seconds=0.0, seconds_in_pytest_thread=0.0, lower_seconds=0.0)
  children = dict(processes=0, programs=0, seconds=0.0, lower_seconds=0.0)
  for r in lines:
    event = r.get("event")
    if event in ("end", "session"):
      total["programs"] += r.get("compiles", 0) + r.get("ahead_compiles", 0)
      total["seconds"] += r.get("compile_s", 0) + r.get("ahead_compile_s", 0)
      total["seconds_in_pytest_thread"] += r.get("compile_s", 0)
      total["lower_seconds"] += r.get("lower_s", 0) + r.get("ahead_lower_s", 0)
    elif event == "oracles":
      children["processes"] += 1
      children["programs"] += r.get("compiles", 0)
      children["seconds"] += r.get("compile_s", 0)
      children["lower_seconds"] += r.get("lower_s", 0)
  rounded = lambda d: {k: round(v, 1) for k, v in d.items()}
  return dict(rounded(total), oracles=rounded(children))


def _lines_from(path: str, offset: int) -> list[dict]:
  with open(path) as f:
    f.seek(offset)
    text = f.read()
  out = []
  for line in text.splitlines():
    try:
      out.append(json.loads(line))
    except json.JSONDecodeError:
      continue      # a line cut off by a kill
  return out


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
        log(f"[tier] {r['outcome']:8s} {r['seconds']:7.1f} s  {r['id']}{_compiles(r)}")
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
        compile_cache: str | None = None, log=print) -> dict:
  """Runs the selected tests (see the module docstring); returns the summary.
  `first`: substrings of test ids to run before the others, in that order;
  `compile_cache`: a folder for jax's persistent compilation cache."""
  start = time.time()
  os.makedirs(out_dir, exist_ok=True)
  results_path = os.path.join(out_dir, "results.jsonl")
  log_path = os.path.join(out_dir, "pytest.log")
  first = list(first or [])
  if rerun_failed:
    kept = [r for r in read_results(results_path).values() if r["outcome"] not in _BAD]
    with open(results_path, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
  open(results_path, "a").close()
  run_from = os.path.getsize(results_path)
  env = dict(os.environ, **{progress.ENV: results_path, progress.FIRST_ENV: "\n".join(first)})
  if compile_cache:
    env.update(JAX_COMPILATION_CACHE_DIR=os.path.abspath(compile_cache),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
               JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  ids = None     # what pytest selects, from its first process (`progress` writes them)
  while True:
    done = read_results(results_path)
    if ids is not None:
      todo = [i for i in ids if i not in done]
      if not todo:
        break
      if time.time() - start > budget_s:
        log(f"[tier] budget of {budget_s:.0f} s spent: {len(todo)} test(s) not run")
        break
      log(f"[tier] starting pytest on {len(todo)} test(s)")
    else:
      log("[tier] starting pytest")
    # The same selection each time (the `-m tpu` also tells tests/conftest.py
    # to keep the chip); `progress` leaves out what already has a result.
    offset = os.path.getsize(results_path)
    with open(log_path, "a") as out:
      proc = _pytest([*pytest_args, "-p", "tests.tpu.progress", "-q"], stdout=out,
                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
    how, current, seconds = _watch(proc, results_path, offset, test_timeout_s, start + budget_s,
                                   poll_s, log)
    if ids is None:
      ids = _collected(results_path, offset)
      if ids is None:
        raise RuntimeError(f"collecting the tests failed (pytest exited with {proc.returncode}):"
                           f"\n{open(log_path).read()[-3000:]}")
    if how == "no_test":
      if all(i in read_results(results_path) for i in ids):
        continue
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
      # Tests run ahead in threads beside the one pytest is at: a crash in one
      # of them is charged to that one. From here on they run one at a time,
      # so that a crash names its test.
      env[progress.AHEAD_ENV] = "0"
  done = read_results(results_path)
  counts = collections.Counter(done[i]["outcome"] for i in ids if i in done)
  not_run = [i for i in ids if i not in done]
  problems = {i: done[i]["message"][-600:] for i in ids
              if i in done and done[i]["outcome"] in _BAD}
  compiling = compile_totals(_lines_from(results_path, run_from))
  summary = dict(collected=len(ids), counts=dict(counts), not_run=not_run, problems=problems,
                 seconds=round(time.time() - start, 1), compiling=compiling)
  with open(os.path.join(out_dir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1)
  for i, msg in problems.items():
    log(f"[tier] {done[i]['outcome'].upper()} {i}\n{msg}\n")
  if not_run:
    shown = not_run[:20]
    log(f"[tier] left, not run ({len(not_run)}; all in summary.json): " + " ".join(shown)
        + (" ..." if len(not_run) > len(shown) else ""))
  children = compiling["oracles"]
  log(f"[tier] compiling: {compiling['programs']} programs, {compiling['seconds']:.0f} s summed"
      f" over threads ({compiling['seconds_in_pytest_thread']:.0f} s in pytest's), tracing and"
      f" lowering {compiling['lower_seconds']:.0f} s"
      + (f"; oracle processes on the CPU ({children['processes']}): {children['programs']}"
         f" programs, {children['seconds']:.0f} s, tracing and lowering"
         f" {children['lower_seconds']:.0f} s" if children["processes"] else ""))
  log(f"[tier] {len(ids)} collected: " + ", ".join(f"{n} {k}" for k, n in counts.items())
      + f", {len(not_run)} not run ({summary['seconds']:.0f} s)")
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
  parser.add_argument("--compile-cache", metavar="DIR2",
                      help="keep compiled programs in jax's persistent cache in DIR2 (outside"
                      " DIR: it holds every executable)")
  args = parser.parse_args(argv)
  summary = run(args.out, pytest_args, budget_s=args.budget_s,
                test_timeout_s=args.test_timeout_s, rerun_failed=args.rerun_failed,
                first=args.first, compile_cache=args.compile_cache)
  bad = sum(summary["counts"].get(k, 0) for k in _BAD)
  return 0 if not bad and not summary["not_run"] else 1


if __name__ == "__main__":
  sys.exit(main())
