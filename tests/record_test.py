"""The performance record (`benchmarks/record.py`): sections rewritten in place."""

import pathlib
import re

from tokamax_gdn import cli
from tokamax_gdn.benchmarks import record


def test_write_section_creates_rewrites_and_keeps_the_rest(tmp_path):
  path = str(tmp_path / "docs" / "performance.md")
  cols = dict(spec="workload", cycles="kcycles")
  record.write_section(path, "a", "Table A", "tokamax-gdn aot --record", [dict(spec="x", cycles=1)],
                       cols, device="v6e (static estimate)")
  record.write_section(path, "b", "Table B", "cmd b", [dict(spec="y", cycles=None)], cols,
                       device="cpu")
  record.write_section(path, "a", "Table A", "tokamax-gdn aot --record", [dict(spec="z", cycles=3)],
                       cols, device="v6e (static estimate)")
  text = open(path).read()
  assert text.startswith("# Performance record")
  assert text.count("<!-- BEGIN a -->") == 1 and text.count("<!-- END b -->") == 1
  assert "| z | 3 |" in text and "| x | 1 |" not in text
  assert text.index("Table A") < text.index("Table B")
  assert "| y |  |" in text
  for package in ("jax", "jaxlib", "libtpu", "tokamax"):
    assert package in text
  assert "Reproduce: `tokamax-gdn aot --record`" in text and "device: v6e (static estimate)" in text


def _record_text():
  return (pathlib.Path(__file__).resolve().parent.parent / "docs" / "performance.md").read_text()


def test_rewriting_a_record_keeps_the_summary_and_the_other_records(tmp_path):
  """docs/performance.md's summary sits outside the markers: a command that
  rewrites one record leaves it, and every other record, as they were."""
  text = _record_text()
  names = re.findall(r"<!-- BEGIN (\S+) -->", text)
  assert len(names) == len(set(names)) >= 10, names
  path = tmp_path / "performance.md"
  path.write_text(text)
  name = names[len(names) // 2]
  record.write_section(str(path), name, "Rewritten", "tokamax-gdn bench --record",
                       [dict(a=1)], dict(a="a"), device="TPU v5 lite")
  new = path.read_text()
  begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
  assert new[:new.index(begin)] == text[:text.index(begin)]
  assert new[new.index(end):] == text[text.index(end):]
  assert "## Rewritten" in new and "## Summary" in new[:new.index("<!-- BEGIN")]


def test_every_record_says_how_to_reproduce_it_with_this_repository():
  """Each record's command is `tokamax-gdn <subcommand>` or a script kept in
  the repository (tools/, the on-chip tier's runner)."""
  root = pathlib.Path(__file__).resolve().parent.parent
  text = _record_text()
  sections = re.findall(r"<!-- BEGIN (\S+) -->(.*?)<!-- END \1 -->", text, re.S)
  for name, body in sections:
    commands = re.findall(r"^Reproduce: `([^`]*)`", body, re.M)
    assert len(commands) == 1, name
    command = commands[0]
    assert "scratch" not in command, (name, command)
    if command.startswith("tokamax-gdn "):
      assert command.split()[1] in cli.COMMANDS, (name, command)
    else:
      m = re.match(r"python (?:-m (tests\.tpu\.runner)|(tools/\S+\.py))\b", command)
      assert m, (name, command)
      script = m.group(2) or m.group(1).replace(".", "/") + ".py"
      assert (root / script).is_file(), (name, script)
