"""The fenced code blocks of README.md and docs/*.md, for the tests that run
them (`docs_test`, and the layer test for the checkpoint block).

A ```python block runs as written. One that cannot run on a CPU-only machine
with nothing but this repository (it needs a TPU, a checkpoint, several
hosts) carries the fence info `python {skip}` and says why on its first line,
a comment starting "# Needs".
"""

import dataclasses
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = "{skip}"
_FENCE = re.compile(r"^(```+|~~~+)\s*(.*)$")


@dataclasses.dataclass(frozen=True)
class Block:
  path: pathlib.Path
  line: int          # 1-based line of the opening fence
  info: str          # the fence's info string, e.g. "python {skip}"
  code: str

  @property
  def language(self) -> str:
    return self.info.split()[0] if self.info.split() else ""

  @property
  def skipped(self) -> bool:
    return SKIP in self.info.split()[1:]

  @property
  def where(self) -> str:
    return f"{self.path.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[pathlib.Path]:
  """README.md, CHANGELOG.md and every docs/*.md."""
  return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def fence_spans(text: str) -> list[tuple[int, int, str]]:
  """(opening line, closing line, info string) of every fenced block, 0-based
  (an unclosed fence is an error: everything after it would silently be code)."""
  lines = text.split("\n")
  spans, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence = m.group(1)
    end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence)
                and not lines[j][len(fence):].strip()), None)
    if end is None:
      raise ValueError(f"line {i + 1}: unclosed code fence")
    spans.append((i, end, m.group(2).strip()))
    i = end + 1
  return spans


def blocks(path: pathlib.Path) -> list[Block]:
  """Every fenced block of one markdown file, in order."""
  text = path.read_text()
  lines = text.split("\n")
  try:
    spans = fence_spans(text)
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None
  return [Block(path, i + 1, info, "\n".join(lines[i + 1:end]) + "\n") for i, end, info in spans]


def python_blocks() -> list[Block]:
  """Every ```python block of README.md and docs/*.md."""
  return [b for p in doc_files() for b in blocks(p) if b.language == "python"]


def block(marker: str) -> Block:
  """The one python block, in any of the files, that contains `marker`."""
  found = [b for b in python_blocks() if marker in b.code]
  assert len(found) == 1, f"{[b.where for b in found]}: {len(found)} blocks contain {marker!r}"
  return found[0]
