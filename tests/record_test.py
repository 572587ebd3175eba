"""The performance record (`benchmarks/record.py`): sections rewritten in place."""

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
