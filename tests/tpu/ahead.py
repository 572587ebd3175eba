"""The on-chip tier's test bodies run ahead of pytest, side by side in threads.

On the chip host a tier test spends nearly all its time on the host: in
XLA's and Mosaic's compilers (which release the GIL) and in tracing and
lowering its programs (Python, which does not), and little on the chip;
pytest runs one test at a time, so one core worked while twelve sat idle.
Side by side, the compiles share the cores and the Python work, one thread
at a time, becomes the bound.
Here the tests' bodies run in a pool of threads, in the order given (the
long ones first), while pytest goes through the tests in its own order: its
call of a test (`tests/tpu/conftest.py`) waits for that test's run and gives
its outcome, a failure raised again with its own traceback. A test pytest
reaches before a thread has taken it runs at once in pytest's thread.

A test runs ahead when its arguments are its parameters only (no fixtures).
Device memory: each test states the bytes it may hold on the chip
(`Plan.device_bytes`); a body starts only while the running ones' sum stays
under the cap (or alone), so that side by side they do not run the chip out
of memory. Tests whose `Plan.gated` is set wait until `open_gate` (the tier
traces programs under module switches first, while nothing else traces).
"""

import dataclasses
import inspect
import os
import threading
import time
from collections.abc import Callable, Iterable

ENV = "TOKAMAX_GDN_TIER_AHEAD"   # "0": off; N: N threads (default: the host's cores less one)


@dataclasses.dataclass(frozen=True)
class Plan:
  """How a test runs ahead: its device bytes, whether it goes first (a long
  test started late would run alone at the end), whether it waits for the gate."""

  device_bytes: int
  early: bool = False
  gated: bool = False


@dataclasses.dataclass(eq=False)
class _Job:
  key: str
  body: Callable[[], object]
  plan: Plan
  state: str = "pending"          # pending / running / done
  error: BaseException | None = None
  seconds: float = 0.0
  thread: str = ""
  done: threading.Event = dataclasses.field(default_factory=threading.Event)


def workers_from_env() -> int:
  """Threads to run tests ahead in: `$TOKAMAX_GDN_TIER_AHEAD`, else the
  host's cores less one (pytest's own thread)."""
  value = os.environ.get(ENV, "").strip()
  if value:
    return max(0, int(value))
  return max(1, (os.cpu_count() or 2) - 1)


def body_of(item) -> Callable[[], object] | None:
  """The test's function bound to its parameters, or None when it takes
  anything else (a fixture: set up only in pytest's own call)."""
  fn = item.obj
  params = getattr(getattr(item, "callspec", None), "params", {})
  names = list(inspect.signature(fn).parameters)
  if any(n not in params for n in names):
    return None
  return lambda: fn(**{n: params[n] for n in names})


class Scheduler:
  """The pool (see the module docstring). `start()` begins, `call(key)` is
  pytest's side, `stop()` ends (what has not started is dropped)."""

  def __init__(self, jobs: Iterable[tuple[str, Callable[[], object], Plan]], *, workers: int,
               device_bytes_cap: int):
    listed = [_Job(key, body, plan) for key, body, plan in jobs]
    self._jobs = {j.key: j for j in listed}
    self._pending = [j for j in listed if j.plan.early] + [j for j in listed if not j.plan.early]
    self._workers = workers
    self._cap = device_bytes_cap
    self._used = 0
    self._claims = 0            # pytest's thread waiting for memory: no new starts meanwhile
    self._gate_open = False
    self._stopped = False
    self._cond = threading.Condition()
    self._threads = []

  def start(self) -> "Scheduler":
    for n in range(self._workers):
      t = threading.Thread(target=self._work, name=f"ahead-{n}", daemon=True)
      t.start()
      self._threads.append(t)
    return self

  def open_gate(self) -> None:
    with self._cond:
      self._gate_open = True
      self._cond.notify_all()

  def _fits(self, job: _Job) -> bool:
    return self._used == 0 or self._used + job.plan.device_bytes <= self._cap

  def _take(self) -> _Job | None:
    """The first pending job that may start now (called holding the lock)."""
    if self._claims:
      return None
    for n, job in enumerate(self._pending):
      if (self._gate_open or not job.plan.gated) and self._fits(job):
        del self._pending[n]
        job.state = "running"
        self._used += job.plan.device_bytes
        return job
    return None

  def _work(self) -> None:
    while True:
      with self._cond:
        job = None
        while not self._stopped and self._pending and (job := self._take()) is None:
          self._cond.wait()
        if job is None:
          return
      self._run(job)

  def _run(self, job: _Job) -> None:
    start = time.perf_counter()
    job.thread = threading.current_thread().name
    try:
      job.body()
    except BaseException as e:  # pylint: disable=broad-exception-caught
      job.error = e
    finally:
      job.seconds = time.perf_counter() - start
      with self._cond:
        self._used -= job.plan.device_bytes
        job.state = "done"
        self._cond.notify_all()
      job.done.set()

  def call(self, key: str) -> _Job | None:
    """pytest's call of test `key`: None when it has no job here; else waits
    for the job (running it now, in this thread, if no thread has taken it)
    and returns it, done (its failure in `error`)."""
    job = self._jobs.get(key)
    if job is None:
      return None
    with self._cond:
      mine = job.state == "pending"
      if mine:
        self._pending.remove(job)
        self._claims += 1
        try:
          while not self._fits(job):
            self._cond.wait()
        finally:
          self._claims -= 1
          self._cond.notify_all()     # the threads held back by the claim
        job.state = "running"
        self._used += job.plan.device_bytes
    if mine:
      self._run(job)
    job.done.wait()
    return job

  def stop(self, timeout_s: float = 60.0) -> None:
    """Drops the jobs no thread has taken and waits for the running ones."""
    with self._cond:
      self._stopped = True
      self._pending.clear()
      self._cond.notify_all()
    deadline = time.monotonic() + timeout_s
    for t in self._threads:
      t.join(max(0.0, deadline - time.monotonic()))


_ACTIVE: Scheduler | None = None


def start(items, plan: Callable[[object], Plan | None], *, workers: int,
          device_bytes_cap: int) -> Scheduler:
  """Runs ahead the bodies of `items` (pytest items, in order) that `plan`
  gives a Plan and that take only their parameters; pytest's calls of those
  tests then go through `call`. Ends with `stop`."""
  global _ACTIVE
  jobs = []
  for item in items:
    how = plan(item)
    body = body_of(item) if how is not None else None
    if body is not None:
      jobs.append((item.nodeid, body, how))
  _ACTIVE = Scheduler(jobs, workers=workers, device_bytes_cap=device_bytes_cap).start()
  return _ACTIVE


def stop() -> None:
  global _ACTIVE
  if _ACTIVE is not None:
    _ACTIVE.stop()
    _ACTIVE = None


def open_gate() -> None:
  if _ACTIVE is not None:
    _ACTIVE.open_gate()


def call(item) -> bool | None:
  """`pytest_pyfunc_call`: True when the test ran ahead (its failure raised
  here), None to let pytest call it."""
  scheduler = _ACTIVE
  job = scheduler.call(item.nodeid) if scheduler is not None else None
  if job is None:
    return None
  item.user_properties.append(("ahead", dict(seconds=round(job.seconds, 2), thread=job.thread)))
  if job.error is not None:
    raise job.error
  return True
