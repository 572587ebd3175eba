"""Results computed once per key, whichever thread asks first.

The on-chip tier runs test bodies side by side in threads (tests/tpu/ahead.py),
and tests of two implementations share one oracle (the reference's results on
one case): the first to ask computes it, the others wait for it instead of
computing it again beside it.
"""

import threading
from collections.abc import Callable, Hashable
from typing import Any


class _Entry:
  __slots__ = ("done", "value", "error")

  def __init__(self):
    self.done = threading.Event()
    self.value = None
    self.error = None


class Once:
  """key -> `compute()`, computed at most once while the key is held.

  A failure is kept too: every test that wants a broken oracle fails with its
  error (a chained `RuntimeError` naming the key, after the first).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._entries: dict[Hashable, _Entry] = {}

  def get(self, key: Hashable, compute: Callable[[], Any]) -> Any:
    with self._lock:
      entry = self._entries.get(key)
      mine = entry is None
      if mine:
        entry = self._entries[key] = _Entry()
    if mine:
      try:
        entry.value = compute()
      except BaseException as e:  # pylint: disable=broad-exception-caught
        entry.error = e
        raise
      finally:
        entry.done.set()
      return entry.value
    entry.done.wait()
    if entry.error is not None:
      raise RuntimeError(f"computing {key!r} failed (in another test)") from entry.error
    return entry.value

  def forget(self, key: Hashable) -> None:
    """Drops the key's result (a later `get` computes it again)."""
    with self._lock:
      self._entries.pop(key, None)

  def __contains__(self, key: Hashable) -> bool:
    with self._lock:
      return key in self._entries
