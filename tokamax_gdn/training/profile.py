"""Where a training step's time goes: GDN, gmm/tgmm and the rest, from one
profiled step.

How: run the compiled step once under `jax.profiler` and read its trace. On
CPU every executed HLO instruction (thunk) is one trace event named after the
instruction; tokamax stamps every instruction an Op emits with HLO metadata
naming the Op's class (`metadata_payload="tokamax:{"op":{"__type":
"tokamax_gdn.ops.gmm.xla.XlaGmm",...`), forward and VJP alike. So each event
is attributed through the compiled module's text: instruction name -> the Op
that emitted it.

Why this and not timing the ops separately: it measures the step as it runs,
with the model's real shapes, its router's real group sizes, rematerialised
forwards and XLA's fusion across op boundaries, in one run. Thunks may run
concurrently on the CPU's threads, so the split is the share of summed
instruction time, scaled to the step's wall time. Control-flow instructions
(while / conditional / call) are skipped: their bodies' instructions are
counted themselves.
"""

import collections
import glob
import gzip
import json
import os
import re
import tempfile
import time
from typing import Any

import jax

GROUPS = {
    "gdn": ("tokamax_gdn.ops.gated_delta_rule.", "tokamax_gdn.ops.causal_conv1d."),
    "gmm/tgmm": ("tokamax_gdn.ops.gmm.", "tokamax_gdn.ops.tgmm."),
}
_CONTROL_FLOW = {"while", "conditional", "call", "async-start", "async-done"}
INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")
OP_TYPE = re.compile(r'tokamax:\{\\?"op\\?":\{\\?"__type\\?":\\?"([\w.]+)')


def opcode(rhs: str) -> str:
  """The opcode of an HLO instruction's right-hand side (`shape opcode(...)`)."""
  i = 0
  if rhs.startswith("("):           # tuple shape: skip to its closing parenthesis
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
  rest = rhs[i + 1:] if rhs.startswith("(") else rhs.split(" ", 1)[-1]
  return rest.strip().split("(", 1)[0].strip()


def instruction_groups(hlo_text: str) -> dict[str, str | None]:
  """Instruction name -> group ("gdn", "gmm/tgmm") or None, for every
  instruction of a compiled HLO module except control flow."""
  out = {}
  for line in hlo_text.splitlines():
    m = INSTRUCTION.match(line)
    if not m:
      continue
    name, rhs = m.groups()
    if opcode(rhs) in _CONTROL_FLOW:
      continue
    group = None
    t = OP_TYPE.search(line)
    if t:
      group = next((g for g, prefixes in GROUPS.items() if t.group(1).startswith(prefixes)), None)
    out[name] = group
  return out


def trace_events(trace_dir: str) -> list[dict[str, Any]]:
  """Every event of the perfetto trace `jax.profiler` wrote under `trace_dir`
  (the newest, with `create_perfetto_trace=True`): durations ("X") and the
  process / thread names ("M")."""
  files = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"),
                           recursive=True))
  if not files:
    raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}.")
  with gzip.open(files[-1]) as f:
    data = json.load(f)
  return data["traceEvents"] if isinstance(data, dict) else data


def trace_calls(fn, calls: int) -> list[dict[str, Any]]:
  """The trace events of `calls` calls of `fn()` under `jax.profiler`, each
  waited for (a caller warms `fn` up first: its compile is not traced)."""
  with tempfile.TemporaryDirectory() as d:
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    try:
      for _ in range(calls):
        jax.block_until_ready(fn())
    finally:
      jax.profiler.stop_trace()
    return trace_events(d)


def traced_call(compiled, *args, trace_dir: str | None = None):
  """Runs `compiled(*args)` once under the profiler: (outputs, wall seconds of
  the call, the trace's events). Donated arguments are consumed as usual."""
  with tempfile.TemporaryDirectory() as tmp:
    d = trace_dir or tmp
    jax.profiler.start_trace(d, create_perfetto_trace=True)
    try:
      t0 = time.perf_counter()
      out = jax.block_until_ready(compiled(*args))
      step = time.perf_counter() - t0
    finally:
      jax.profiler.stop_trace()
    return out, step, trace_events(d)


def split_events(groups: dict[str, str | None], events: list[dict[str, Any]],
                 step: float) -> dict[str, float]:
  """The split of `profiled_call` from a call's trace `events`, `groups` being
  `instruction_groups` of its module and `step` its wall time."""
  per_group = collections.Counter()
  for e in events:
    if e.get("ph") == "X" and e.get("name") in groups:
      per_group[groups[e["name"]]] += float(e.get("dur", 0.0))
  total = sum(per_group.values())
  if not total:
    raise RuntimeError("No trace event matched an instruction of the compiled step.")
  split = {"step": step}
  for g in GROUPS:
    split[g] = step * per_group[g] / total
  split["rest"] = step - sum(split[g] for g in GROUPS)
  return split


def profiled_call(compiled, *args, trace_dir: str | None = None):
  """Runs `compiled(*args)` once under the profiler: (outputs, seconds per group).

  The split has "step" (wall time of the call), each `GROUPS` key and "rest"
  (step minus the groups). `compiled` is a `jax.stages.Compiled` (its module
  text names the instructions); donated arguments are consumed as usual.
  """
  groups = instruction_groups(compiled.as_text())
  out, step, events = traced_call(compiled, *args, trace_dir=trace_dir)
  return out, split_events(groups, events, step)
