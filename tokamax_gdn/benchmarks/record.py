"""The performance record: `docs/performance.md`, one generated section per table.

Measured figures live here, not in docstrings, where they go stale. Each
section is rewritten whole by the command that measures it and carries its
date, the versions that produced it (jax, jaxlib, libtpu, tokamax), the device
and the command that reproduces it. Sections sit between HTML comment
markers, so the prose around them is kept.
"""

from collections.abc import Mapping, Sequence
import datetime
import importlib.metadata
import os
import re
from typing import Any

DEFAULT_PATH = os.path.join("docs", "performance.md")

_HEADER = """# Performance record

Generated: each section below is rewritten by the command it names (for
example `tokamax-gdn aot --target v6e --record`). Figures are only comparable
within one section: same versions, same device, same command.
"""


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "not installed"


def versions() -> dict[str, str]:
  """The versions a record depends on, by package name."""
  return {p: _version(p) for p in ("jax", "jaxlib", "libtpu", "tokamax")}


def _markers(name: str) -> tuple[str, str]:
  return f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"


def _cell(value: Any) -> str:
  return "" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def render_section(name: str, title: str, command: str, rows: Sequence[Mapping[str, Any]],
                   columns: Mapping[str, str], *, device: str,
                   date: datetime.date | None = None) -> str:
  """The section's markdown, markers included (`write_section`)."""
  begin, end = _markers(name)
  date = date or datetime.date.today()
  stamp = ", ".join(f"{p} {v}" for p, v in versions().items())
  lines = [begin, f"## {title}", "",
           f"{date.isoformat()}; {stamp}; device: {device}.", "",
           f"Reproduce: `{command}`", "",
           markdown_table(rows, columns), end]
  return "\n".join(lines)


def markdown_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str]) -> str:
  """rows as a markdown table: columns maps row keys to headers, in order;
  None is an empty cell."""
  lines = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
  lines += ["| " + " | ".join(_cell(row.get(k)) for k in columns) + " |" for row in rows]
  return "\n".join(lines)


def write_section(path: str | None, name: str, title: str, command: str,
                  rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str], *,
                  device: str | None = None) -> str:
  """Rewrites section `name` of the record at `path` (created if missing;
  None: `DEFAULT_PATH`), or appends it; returns the path.

  rows: one mapping per table row; columns: row key -> column header, in
  order. device: what ran it (default: the first JAX device's kind).
  """
  path = path or DEFAULT_PATH
  if device is None:
    import jax  # pylint: disable=g-import-not-at-top
    device = jax.devices()[0].device_kind
  section = render_section(name, title, command, rows, columns, device=device)
  text = open(path).read() if os.path.exists(path) else _HEADER
  begin, end = _markers(name)
  pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.S)
  if pattern.search(text):
    text = pattern.sub(lambda _: section, text)
  else:
    text = text.rstrip("\n") + "\n\n" + section + "\n"
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    f.write(text if text.endswith("\n") else text + "\n")
  return path
