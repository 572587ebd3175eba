"""Progress bars: tqdm on a terminal; off a terminal plain lines (no carriage
returns piling up in logs), at most every PLAIN_EVERY_S seconds, and one at
the end; nothing when disabled."""

import io

import tqdm

from tokamax_gdn import progress


class _Tty(io.StringIO):
  def isatty(self):
    return True


def test_off_a_terminal_plain_lines(monkeypatch):
  out = io.StringIO()
  monkeypatch.setattr(progress, "PLAIN_EVERY_S", 0.0)     # a line per update
  bar = progress.bar(total=3, desc="train", file=out)
  for i in range(3):
    bar.update(1)
    bar.set_postfix(loss=f"{1.0 / (i + 1):.3f}")
  bar.close()
  text = out.getvalue()
  assert "\r" not in text
  lines = text.splitlines()
  assert lines[0].startswith("train: 1/3") and lines[-1].startswith("train: 3/3")
  assert lines[-1].endswith("loss=0.333")


def test_off_a_terminal_rate_limited_and_iterable(monkeypatch):
  out = io.StringIO()
  monkeypatch.setattr(progress, "PLAIN_EVERY_S", 3600.0)
  assert list(progress.bar(range(50), desc="validate", file=out)) == list(range(50))
  assert out.getvalue().splitlines() == [out.getvalue().splitlines()[0]]
  assert out.getvalue().startswith("validate: 50/50")


def test_terminal_gets_tqdm_and_disabled_prints_nothing():
  assert isinstance(progress.bar(total=2, file=_Tty()), tqdm.tqdm)
  out = io.StringIO()
  bar = progress.bar(total=2, file=out, disable=True)
  bar.update(2)
  bar.close()
  assert out.getvalue() == ""
