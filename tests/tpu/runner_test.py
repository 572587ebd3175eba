"""The tier runner (`tests/tpu/runner.py`) on CPU, over a file of fake tests:
a pass, a failure, a stall, a crash of the process, and tests after each."""

import json
import os
import textwrap
import time

from tests.tpu import runner

_FAKE = textwrap.dedent("""
    import os, time

    def test_a_pass():
      import jax, jax.numpy as jnp
      jax.jit(lambda x: x * 3)(jnp.ones(7)).block_until_ready()

    def test_b_fail():
      assert 1 == 2, "wrong"

    def test_c_stall():
      time.sleep(60)

    def test_d_after_stall():
      pass

    def test_e_crash():
      os.abort()

    def test_f_after_crash():
      pass
""")


def _args(tmp_path):
  return ["-p", "no:xdist", "-p", "no:cacheprovider", "-c", "/dev/null", "--rootdir",
          str(tmp_path), str(tmp_path / "test_fake.py")]


def test_stalls_and_crashes_are_contained_and_the_rest_runs(tmp_path, monkeypatch):
  (tmp_path / "test_fake.py").write_text(_FAKE)
  out = tmp_path / "out"
  lines, started = [], []
  real = runner._pytest  # pylint: disable=protected-access
  monkeypatch.setattr(runner, "_pytest", lambda args, **kw: started.append(args) or real(args, **kw))
  summary = runner.run(str(out), _args(tmp_path), budget_s=120, test_timeout_s=4, poll_s=0.1,
                       log=lines.append)
  # Three pytest processes (the first, then one after the stall and one after
  # the crash), no separate collection (on the chip host it would open the
  # chip once more).
  assert len(started) == 3 and not any("--collect-only" in a for a in started)
  results = runner.read_results(str(out / "results.jsonl"))
  outcome = {i.split("::")[-1]: r["outcome"] for i, r in results.items()}
  assert outcome == dict(test_a_pass="passed", test_b_fail="failed", test_c_stall="timeout",
                         test_d_after_stall="passed", test_e_crash="crashed",
                         test_f_after_crash="passed")
  assert summary["counts"] == dict(passed=3, failed=1, timeout=1, crashed=1)
  assert not summary["not_run"] and len(summary["problems"]) == 3
  assert "wrong" in results[next(i for i in results if "b_fail" in i)]["message"]
  assert json.load(open(out / "summary.json"))["collected"] == 6
  assert any("timeout" in line and "c_stall" in line for line in lines)
  # Each result carries the test's compile count and seconds.
  a_pass = results[next(i for i in results if "a_pass" in i)]
  assert a_pass["compiles"] >= 1 and a_pass["compile_s"] > 0
  assert any("lambda" in name for name, _ in a_pass["slowest"]), a_pass["slowest"]
  assert results[next(i for i in results if "d_after" in i)]["compiles"] == 0


class _ClockPastBudgetInStall:
  """The runner's `time`, whose clock jumps a day ahead once test_c_stall has
  started (its start line is in the results): the budget runs out in the
  stall on a machine of any load, without a CI worker waiting for it."""

  sleep = staticmethod(time.sleep)

  def __init__(self, results_path):
    self._results = results_path

  def time(self):
    stalled = False
    if os.path.exists(self._results):
      with open(self._results) as f:
        stalled = any(line.startswith('{"event": "start"') and "test_c_stall" in line
                      for line in f)
    return time.time() + (86400.0 if stalled else 0.0)


def test_a_spent_budget_leaves_tests_for_the_next_call(tmp_path, monkeypatch):
  (tmp_path / "test_fake.py").write_text(_FAKE)
  out = tmp_path / "out"
  # The budget runs out in the stall: it and what follows are not run.
  lines = []
  with monkeypatch.context() as m:
    m.setattr(runner, "time", _ClockPastBudgetInStall(str(out / "results.jsonl")))
    first = runner.run(str(out), _args(tmp_path), budget_s=600, test_timeout_s=120,
                       poll_s=0.1, log=lines.append)
  assert "c_stall" in " ".join(first["not_run"])
  # The closing lines say what is left.
  (left,) = [line for line in lines if line.startswith("[tier] left, not run (4;")]
  assert "test_c_stall" in left and "test_f_after_crash" in left
  assert first["counts"] == dict(passed=1, failed=1)
  # ...and a second call with the same folder and a short timeout runs only those.
  second = runner.run(str(out), _args(tmp_path), budget_s=120, test_timeout_s=3, poll_s=0.1,
                      log=lambda _: None)
  assert not second["not_run"]
  assert second["counts"] == dict(passed=3, failed=1, timeout=1, crashed=1)
  # --rerun-failed drops the bad results and runs those tests again.
  third = runner.run(str(out), _args(tmp_path), budget_s=120, test_timeout_s=3, poll_s=0.1,
                     rerun_failed=True, log=lambda _: None)
  assert third["counts"] == dict(passed=3, failed=1, timeout=1, crashed=1)


def test_first_runs_the_named_tests_before_the_rest(tmp_path):
  (tmp_path / "test_fake.py").write_text(_FAKE)
  out = tmp_path / "out"
  summary = runner.run(str(out), [*_args(tmp_path), "-k", "not c_stall and not e_crash"],
                       budget_s=120, test_timeout_s=30, poll_s=0.1,
                       first=["f_after", "d_after"], log=lambda _: None)
  assert summary["counts"] == dict(passed=3, failed=1)
  starts = [json.loads(line)["id"].split("::")[-1] for line in open(out / "results.jsonl")
            if json.loads(line)["event"] == "start"]
  assert starts == ["test_f_after_crash", "test_d_after_stall", "test_a_pass", "test_b_fail"]


_FAKE_AHEAD = textwrap.dedent("""
    import threading, time
    import pytest

    @pytest.mark.parametrize("n", range(4))
    def test_ahead(n):
      import jax, jax.numpy as jnp
      time.sleep(0.3)
      jax.jit(lambda x: x * n)(jnp.ones(5 + n)).block_until_ready()
      open(f"{WHERE}/{n}", "w").write(threading.current_thread().name)
      assert n != 3, "three fails"

    def test_with_a_fixture(tmp_path):
      open(f"{WHERE}/fixture", "w").write(threading.current_thread().name)
""")

_FAKE_AHEAD_CONFTEST = textwrap.dedent("""
    import pytest
    from tests.tpu import ahead

    def pytest_pyfunc_call(pyfuncitem):
      return ahead.call(pyfuncitem)

    @pytest.fixture(scope="module", autouse=True)
    def _run_ahead(request):
      ahead.start(request.session.items, lambda item: ahead.Plan(1), workers=3,
                  device_bytes_cap=4)
      ahead.open_gate()
      yield
      ahead.stop()
""")


def test_bodies_run_ahead_in_threads_and_the_summary_counts_their_compiles(tmp_path):
  where = tmp_path / "where"
  where.mkdir()
  (tmp_path / "test_fake.py").write_text(_FAKE_AHEAD.replace("{WHERE}", str(where)))
  (tmp_path / "conftest.py").write_text(_FAKE_AHEAD_CONFTEST)
  out = tmp_path / "out"
  lines = []
  summary = runner.run(str(out), ["-p", "no:xdist", "-p", "no:cacheprovider", "--rootdir",
                                  str(tmp_path), str(tmp_path / "test_fake.py")],
                       budget_s=120, test_timeout_s=60, poll_s=0.1, log=lines.append)
  assert summary["counts"] == dict(passed=4, failed=1)
  results = runner.read_results(str(out / "results.jsonl"))
  three = results[next(i for i in results if "test_ahead[3]" in i)]
  assert "three fails" in three["message"]
  ran = {f.name: f.read_text() for f in where.iterdir()}
  assert all(ran[str(n)].startswith("ahead-") for n in range(4)), ran
  assert ran["fixture"] == "MainThread"
  assert all("ahead" in results[i] for i in results if "test_ahead[" in i)
  # Every compile is counted once, wherever it ran: the four bodies' jits
  # (and jnp.ones) in the threads, none lost between the tests' lines.
  compiling = summary["compiling"]
  assert compiling["programs"] >= 8 and compiling["seconds"] > 0
  assert compiling["seconds_in_pytest_thread"] < compiling["seconds"]
  assert json.load(open(out / "summary.json"))["compiling"] == compiling
  assert any(line.startswith("[tier] compiling: ") for line in lines)
