"""`tests/tpu/ahead.py` on CPU: test bodies run in threads within the device
memory cap, the long ones first, gated ones after the gate, one no thread
has taken run by the caller, and each test's outcome handed to its caller."""

import threading
import time

import pytest

from tests.tpu import ahead


class _Recorder:
  """Bodies that note when they run, where, and the device bytes in use."""

  def __init__(self):
    self.lock = threading.Lock()
    self.order, self.threads, self.peak, self._in_use = [], {}, 0, 0

  def body(self, key, nbytes, sleep_s=0.05, error=None):
    def run():
      with self.lock:
        self.order.append(key)
        self.threads[key] = threading.current_thread().name
        self._in_use += nbytes
        self.peak = max(self.peak, self._in_use)
      time.sleep(sleep_s)
      with self.lock:
        self._in_use -= nbytes
      if error is not None:
        raise error
    return run


def test_bodies_stay_within_the_device_cap_and_long_ones_go_first():
  rec = _Recorder()
  jobs = [(f"t{n}", rec.body(f"t{n}", 4), ahead.Plan(4)) for n in range(8)]
  jobs.append(("long", rec.body("long", 6), ahead.Plan(6, early=True)))
  sched = ahead.Scheduler(jobs, workers=4, device_bytes_cap=10).start()
  try:
    for key, _, _ in jobs:
      job = sched.call(key)
      assert job.error is None and job.state == "done"
  finally:
    sched.stop()
  # Dispatched first (its thread may note it a moment after the next one's).
  assert "long" in rec.order[:2]
  assert rec.peak <= 10, rec.peak
  assert all(name.startswith("ahead-") for name in rec.threads.values())


def test_gated_bodies_wait_for_the_gate():
  rec = _Recorder()
  jobs = [("gated", rec.body("gated", 1), ahead.Plan(1, gated=True)),
          ("free", rec.body("free", 1), ahead.Plan(1))]
  sched = ahead.Scheduler(jobs, workers=2, device_bytes_cap=10).start()
  try:
    assert sched.call("free").error is None
    time.sleep(0.2)
    assert rec.order == ["free"]
    sched.open_gate()
    assert sched.call("gated").error is None
  finally:
    sched.stop()
  assert rec.order == ["free", "gated"]


def test_a_body_no_thread_took_runs_in_the_callers_thread():
  rec = _Recorder()
  # One thread, busy with the first body: the caller takes the third itself.
  jobs = [("slow", rec.body("slow", 1, sleep_s=1.0), ahead.Plan(1)),
          ("second", rec.body("second", 1), ahead.Plan(1)),
          ("third", rec.body("third", 1), ahead.Plan(1))]
  sched = ahead.Scheduler(jobs, workers=1, device_bytes_cap=10).start()
  try:
    time.sleep(0.1)
    assert sched.call("third").thread == threading.current_thread().name
  finally:
    sched.stop()
  assert rec.threads["third"] == threading.current_thread().name
  assert sched.call("nothing") is None


def test_a_body_s_failure_is_handed_to_its_caller():
  rec = _Recorder()
  jobs = [("bad", rec.body("bad", 1, error=AssertionError("wrong")), ahead.Plan(1)),
          ("skip", rec.body("skip", 1, error=pytest.skip.Exception("not here")), ahead.Plan(1))]
  sched = ahead.Scheduler(jobs, workers=2, device_bytes_cap=10).start()
  try:
    bad, skip = sched.call("bad"), sched.call("skip")
  finally:
    sched.stop()
  assert isinstance(bad.error, AssertionError) and "wrong" in str(bad.error)
  # Its traceback reaches into the body, where it was raised.
  assert bad.error.__traceback__ is not None
  assert isinstance(skip.error, pytest.skip.Exception)


def test_a_test_with_fixtures_does_not_run_ahead():
  class _Item:
    callspec = type("C", (), {"params": {"x": 1}})()

    def __init__(self, obj):
      self.obj = obj

  assert ahead.body_of(_Item(lambda x: x * 2))() == 2
  assert ahead.body_of(_Item(lambda x, tmp_path: x)) is None


def test_workers_from_the_environment(monkeypatch):
  monkeypatch.setenv(ahead.ENV, "0")
  assert ahead.workers_from_env() == 0
  monkeypatch.setenv(ahead.ENV, "5")
  assert ahead.workers_from_env() == 5
  monkeypatch.delenv(ahead.ENV)
  assert ahead.workers_from_env() >= 1
