"""The documentation stays true: README.md and docs/*.md.

- Every ```python block runs as written: extracted and executed, verbatim, in
  a fresh Python process (blocks run in parallel, a few at a time). Nothing is
  injected; the process gets this repository on its path and XLA's quick
  compile mode (`JAX_DISABLE_MOST_OPTIMIZATIONS`, as the rest of the suite).
  A block that cannot run here is fenced `python {skip}`, says why on its
  first line ("# Needs ..."), and is run by the test named in `RUN_ELSEWHERE`.
- Every relative link and #anchor resolves (GitHub's heading slugs).
- No text the package documents or prints names the development process:
  the docs, the CHANGELOG, and every subcommand's --help.
"""

import argparse
import concurrent.futures
import inspect
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import unicodedata

import pytest

from tests import doc_blocks
from tests.layers import gated_deltanet_test
from tokamax_gdn import cli

ROOT = doc_blocks.ROOT
README_MAX_LINES = 400
BLOCK_TIMEOUT_S = 600

# Skipped blocks -> the test that runs each (found by a marker in its code).
RUN_ELSEWHERE = {
    "load_hf_layer(": gated_deltanet_test.test_docs_checkpoint_block,
}


def _run(block: doc_blocks.Block, tmp: pathlib.Path) -> tuple[doc_blocks.Block, int, str]:
  script = tmp / (block.where.replace("/", "_").replace(":", "_line") + ".py")
  script.write_text(block.code)
  env = dict(os.environ, JAX_DISABLE_MOST_OPTIMIZATIONS="1",
             PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
  try:
    p = subprocess.run([sys.executable, str(script)], cwd=tmp, env=env, capture_output=True,
                       text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    return block, p.returncode, p.stdout + p.stderr
  except subprocess.TimeoutExpired:
    return block, -1, f"timed out after {BLOCK_TIMEOUT_S} s"


def test_every_python_block_runs_as_written(tmp_path):
  todo = [b for b in doc_blocks.python_blocks() if not b.skipped]
  assert len(todo) >= 8, [b.where for b in todo]    # one per op, the layer, the model
  workers = max(2, min(4, os.cpu_count() or 2))
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    results = list(pool.map(lambda b: _run(b, tmp_path), todo))
  failed = [f"{b.where} exited {rc}:\n{out[-3000:]}" for b, rc, out in results if rc != 0]
  assert not failed, "\n\n".join(failed)


def test_skipped_blocks_say_why_and_run_elsewhere():
  for b in doc_blocks.python_blocks():
    if not b.skipped:
      assert not b.code.startswith("# Needs"), f"{b.where}: it needs something: fence it {{skip}}"
      continue
    first = b.code.split("\n", 1)[0]
    assert re.fullmatch(r"# Needs \S.{10,}", first), f"{b.where}: first line must say what it needs"
    runners = [t for marker, t in RUN_ELSEWHERE.items() if marker in b.code]
    assert len(runners) == 1, f"{b.where}: no test in RUN_ELSEWHERE runs this skipped block"
  for marker, test in RUN_ELSEWHERE.items():
    assert doc_blocks.block(marker).skipped, marker
    source = inspect.getsource(test)
    assert any(f"doc_blocks.block({q}{marker}{q})" in source for q in "'\""), test


def test_readme_is_short():
  n = len((ROOT / "README.md").read_text().splitlines())
  assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES})"


# ------------------------------------------------------------------ links
def _outside_fences(text: str) -> str:
  """The markdown text with its fenced blocks blanked (line count kept)."""
  lines = text.split("\n")
  for start, end, _ in doc_blocks.fence_spans(text):
    for i in range(start, end + 1):
      lines[i] = ""
  return "\n".join(lines)


def github_slug(heading: str) -> str:
  """GitHub's anchor for a heading's text: markup dropped, lower case, every
  character but letters, marks, numbers, '_', '-' and spaces removed, spaces
  to '-'."""
  text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # a link's text
  text = text.replace("`", "").strip().lower()
  kept = "".join(c for c in text if c in " -" or unicodedata.category(c)[0] in "LMN"
                 or unicodedata.category(c) == "Pc")
  return kept.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
  """Every heading anchor of a markdown file (repeats get -1, -2, ... as on GitHub)."""
  seen: dict[str, int] = {}
  out = set()
  for line in _outside_fences(path.read_text()).split("\n"):
    m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
    if not m:
      continue
    slug = github_slug(m.group(1))
    n = seen.get(slug, 0)
    seen[slug] = n + 1
    out.add(slug if n == 0 else f"{slug}-{n}")
  return out


def test_github_slug():
  assert github_slug("Long context: T over devices") == "long-context-t-over-devices"
  assert (github_slug("`causal_conv1d_gated_delta_rule` (serving)")
          == "causal_conv1d_gated_delta_rule-serving")
  assert github_slug("Training: `tokamax-gdn train`") == "training-tokamax-gdn-train"
  assert github_slug("The inverse T = (I + A)⁻¹") == "the-inverse-t--i--a¹"


def test_relative_links_and_anchors_resolve():
  bad = []
  for path in doc_blocks.doc_files():
    text = re.sub(r"`[^`\n]*`", "", _outside_fences(path.read_text()))   # inline code is no link
    for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", text):
      target = m.group(1)
      if re.match(r"^[a-z][a-z0-9+.-]*:", target):      # http:, https:, mailto:
        continue
      file_part, _, anchor = target.partition("#")
      dest = (path.parent / file_part).resolve() if file_part else path
      where = f"{path.relative_to(ROOT)}: ({target})"
      if not dest.exists():
        bad.append(f"{where}: no such file")
      elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
        bad.append(f"{where}: no heading with that anchor")
  assert not bad, "\n".join(bad)


# ------------------------------------------------------------------ wording
# Words of the development process, not of the product.
PROCESS_WORDS = [
    r"\bissues?\s*#?\d+", r"\b(?:the|this|that|an|our)\s+issue\b", r"(?<![\w/&])#\d+\b",
    r"\bPR\s*#?\d+", r"\bround\s*\d+", r"\bround's\b",
    r"\b(?:this|that|last|next|previous|each|the|a)\s+round\b(?!\s*-?\s*trips?)",
    r"\bsessions?\b", r"\bscratch(?:/|\s+scripts?)", r"\blab notes?\b", r"\bcoordinator\b",
    r"\bhelpers?'s? (?:run|session|branch)",
]


def process_words(text: str) -> list[str]:
  return [m.group(0) for pattern in PROCESS_WORDS
          for m in re.finditer(pattern, text, re.IGNORECASE)]


def test_process_word_patterns():
  for text in ("(issue 40)", "the issue that opened this round", "this round's targets",
               "a scratch script", "nine sessions", "see #5098", "round 2"):
    assert process_words(text), text
  for text in ("the host's round trip", "calls issued back to back", "rounded to bf16",
               "interleaved rounds", "training from scratch", "docs/x.md#anchor"):
    assert not process_words(text), text


def _help_texts():
  """({command: its --help text}, the subcommands' parsers' action)."""
  parser = cli.build_parser()
  texts = {"tokamax-gdn": parser.format_help()}
  sub = next(a for a in parser._actions  # pylint: disable=protected-access
             if isinstance(a, argparse._SubParsersAction))  # pylint: disable=protected-access
  texts.update({f"tokamax-gdn {n}": p.format_help() for n, p in sub.choices.items()})
  return texts, sub


def test_docs_do_not_name_the_development_process():
  found = {str(p.relative_to(ROOT)): process_words(p.read_text()) for p in doc_blocks.doc_files()}
  assert not {k: v for k, v in found.items() if v}, found


def test_help_texts_do_not_name_the_process_or_constants():
  """Every subcommand's --help: no process words, and no module constant named
  where its value belongs (ALL_CAPS words that are neither an option's metavar
  nor an environment variable)."""
  texts, sub = _help_texts()
  problems = {}
  for name, text in texts.items():
    parser = sub.choices.get(name.split()[-1])
    metavars = set()
    for action in (parser._actions if parser else []):  # pylint: disable=protected-access
      mv = action.metavar if isinstance(action.metavar, str) else action.dest.upper()
      metavars.update(re.findall(r"[A-Z][A-Z0-9_]+", mv))
    constants = [w for w in re.findall(r"\b[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)+\b", text)
                 if w not in metavars and not w.startswith(("TOKAMAX_GDN_", "XLA_", "JAX_"))]
    if process_words(text) or constants:
      problems[name] = process_words(text) + constants
  assert not problems, problems
