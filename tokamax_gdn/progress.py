"""Progress bars that keep logs readable.

On a terminal, a tqdm bar. Elsewhere (a log file, a pipe, CI) tqdm's
carriage-return frames pile up into one huge line, so `bar` prints a plain
line at most every `PLAIN_EVERY_S` seconds, and one when it closes.
"""

import sys
import time
from typing import Any, Iterable, TextIO

import tqdm

PLAIN_EVERY_S = 5.0


def bar(iterable: Iterable[Any] | None = None, *, total: int | None = None, desc: str = "",
        disable: bool = False, file: TextIO | None = None, **tqdm_kwargs):
  """A tqdm bar (iterate it, or call update / set_postfix / close) on a
  terminal, plain lines elsewhere, nothing when `disable`."""
  file = file or sys.stderr
  if disable or _isatty(file):
    return tqdm.tqdm(iterable, total=total, desc=desc, disable=disable, file=file,
                     **tqdm_kwargs)
  return _PlainLines(iterable, total, desc, file)


def _isatty(file) -> bool:
  try:
    return file.isatty()
  except (AttributeError, ValueError):
    return False


class _PlainLines:
  """tqdm's interface, printing "desc: n/total key=value ..." lines."""

  def __init__(self, iterable, total, desc, file):
    self.iterable, self.desc, self.file = iterable, desc, file
    if total is None and hasattr(iterable, "__len__"):
      total = len(iterable)
    self.total, self.n, self.postfix = total, 0, ""
    self.start = self.last = time.monotonic()
    self.closed = False

  def __iter__(self):
    try:
      for x in self.iterable:
        yield x
        self.update(1)
    finally:
      self.close()

  def update(self, n: int = 1) -> None:
    self.n += n
    if time.monotonic() - self.last >= PLAIN_EVERY_S:
      self._print()

  def set_postfix(self, **values) -> None:
    self.postfix = " ".join(f"{k}={v}" for k, v in values.items())

  def set_postfix_str(self, text: str) -> None:
    self.postfix = text

  def write(self, text: str, file: TextIO | None = None) -> None:
    """A line of its own (tqdm's `write`)."""
    print(text, file=file or self.file, flush=True)

  def close(self) -> None:
    if not self.closed:
      self.closed = True
      self._print()

  def _print(self) -> None:
    self.last = time.monotonic()
    count = f"{self.n}/{self.total}" if self.total is not None else str(self.n)
    head = f"{self.desc}: " if self.desc else ""
    print(f"{head}{count} ({self.last - self.start:.0f} s) {self.postfix}".rstrip(),
          file=self.file, flush=True)
