"""The README's ```python blocks, for the tests that run them (readme_test,
the layer test, the context-parallel checks' subprocess, which loads this
file by path)."""

import pathlib

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
  """Every ```python block of README.md, in order."""
  return [b.split("```")[0] for b in README.read_text().split("```python\n")[1:]]


def block(marker: str) -> str:
  """The one README python block that contains `marker`."""
  found = [b for b in python_blocks() if marker in b]
  assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}"
  return found[0]
