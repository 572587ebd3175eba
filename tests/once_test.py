"""`tests.once.Once`: one computation per key, whichever thread asks first;
a failure reaches every asker."""

import threading
import time

import pytest

from tests import once


def test_threads_asking_together_share_one_computation():
  cache, calls = once.Once(), []

  def compute():
    calls.append(1)
    time.sleep(0.2)          # the others ask while it runs
    return object()

  got = []
  threads = [threading.Thread(target=lambda: got.append(cache.get("k", compute)))
             for _ in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  assert len(calls) == 1 and len(got) == 4 and all(g is got[0] for g in got)
  cache.forget("k")
  assert "k" not in cache
  assert cache.get("k", compute) is not got[0] and len(calls) == 2


def test_a_failure_reaches_every_asker():
  cache = once.Once()

  def broken():
    raise ValueError("bad oracle")

  with pytest.raises(ValueError, match="bad oracle"):
    cache.get("k", broken)
  with pytest.raises(RuntimeError, match="in another test") as later:
    cache.get("k", lambda: 1)
  assert isinstance(later.value.__cause__, ValueError)
