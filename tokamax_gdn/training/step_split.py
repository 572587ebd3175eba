"""Where a training step's device time goes: GDN, gmm/tgmm, attention, the rest.

Reads a `jax.profiler` trace of compiled steps on a TPU: the device's op
tracks ("XLA Ops") hold one event per executed HLO instruction or Pallas
kernel, named after the instruction of the compiled module (a Pallas call's
instruction is named after its kernel: `gdn_bwd.18`, `tokamax_gdn_gmm.76`).
Each event is put in a bucket through that module's text:

  gdn        the gated delta rule and the causal conv: instructions a
             `tokamax_gdn.ops.gated_delta_rule` / `causal_conv1d` Op emitted
             (tokamax stamps its Ops' instructions with their class in the
             HLO metadata, forward and VJP, Pallas kernel or XLA fusion
             alike), or kernels named `gdn_*`.
  gmm/tgmm   the MoE's grouped matmuls: instructions of the `gmm` / `tgmm`
             Ops, `ragged-dot`s, kernels named `tokamax_gdn_gmm` / `_tgmm`.
  attention  the softmax-attention core (scores, mask, softmax, weighted
             values): instructions whose innermost source frame is in
             `models/softmax_attention.py` (splash attention's kernels, or
             the jnp formula) or is `models.blocks.attention`, or kernels
             named `splash_*`. The q/k/v/o projections, norms and rope are in
             `rest`, as the GDN layer's projections and gated norm are: both
             mixers' buckets are their sequence mixing.
  rest       everything else (projections, norms, router, loss, AdamW,
             copies).

Nested events on one track (a loop's event around its body's) count their
own time only, so nothing is counted twice. Off TPU (CPU) the trace has no
device track: `device_split` returns None and the caller says that the split
needs a TPU (`training.profile` splits a CPU step by its thunks instead).
"""

import collections
import dataclasses
import re
from typing import Any, Iterable

from tokamax_gdn.training import profile

GDN, GMM, ATTENTION, REST = "gdn", "gmm/tgmm", "attention", "rest"
BUCKETS = (GDN, GMM, ATTENTION, REST)
LABELS = {GDN: "GDN (gated delta rule + conv)", GMM: "gmm/tgmm", ATTENTION: "attention core",
          REST: "rest"}

# The serving op (conv + recurrence, `causal_conv1d_gated_delta_rule`) is GDN
# too: `benchmarks.generation` splits a model's serving steps with these.
_OP_PREFIXES = {
    GDN: ("tokamax_gdn.ops.gated_delta_rule.", "tokamax_gdn.ops.causal_conv1d.",
          "tokamax_gdn.ops.causal_conv1d_gated_delta_rule."),
    GMM: ("tokamax_gdn.ops.gmm.", "tokamax_gdn.ops.tgmm."),
}
# Source files of the ops (an instruction without the Op's metadata stamp,
# e.g. a fusion whose root XLA took from inside the Op's jnp code).
_OP_DIRS = {
    GDN: ("tokamax_gdn/ops/gated_delta_rule/", "tokamax_gdn/ops/causal_conv1d/",
          "tokamax_gdn/ops/causal_conv1d_gated_delta_rule/"),
    GMM: ("tokamax_gdn/ops/gmm/", "tokamax_gdn/ops/tgmm/"),
}
_ATTENTION_FRAME = ("tokamax_gdn/models/blocks.py", "attention")
_ATTENTION_FILE = "tokamax_gdn/models/softmax_attention.py"
_KERNEL_PATTERNS = (
    (GDN, re.compile(r"^gdn_")),
    (GMM, re.compile(r"^(tokamax_gdn_)?t?gmm\b|ragged[-_]dot")),
    (ATTENTION, re.compile(r"^splash_")),
)

_FRAME_ID = re.compile(r"\bstack_frame_id=(\d+)")
_OP_NAME = re.compile(r'\bop_name="([^"]*)"')
_TABLE_ROW = re.compile(r"^(\d+)\s+(.*)$")
_FIELDS = re.compile(r"(\w+)=(\d+)")
_SUFFIX = re.compile(r"\.\d+$")


@dataclasses.dataclass(frozen=True)
class Instruction:
  """What the split needs of one HLO instruction."""

  opcode: str
  op_type: str | None          # the tokamax Op class that emitted it
  file: str | None             # innermost source frame
  function: str | None
  op_name: str = ""            # JAX's name for it (`jit(step)/transpose(jvp())/.../dot_general`)


def _frames(lines: list[str]) -> dict[int, tuple[str, str]]:
  """Stack frame id -> (file, function), from the module text's tables."""
  tables, current = collections.defaultdict(dict), None
  for line in lines:
    if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
      current = line
      continue
    if current is None:
      continue
    m = _TABLE_ROW.match(line)
    if not m:
      if line.strip():
        current = None
      continue
    tables[current][int(m.group(1))] = m.group(2)
  files = {k: v.strip('"') for k, v in tables["FileNames"].items()}
  functions = {k: v.strip('"') for k, v in tables["FunctionNames"].items()}
  locations = {k: dict((a, int(b)) for a, b in _FIELDS.findall(v))
               for k, v in tables["FileLocations"].items()}
  out = {}
  for k, v in tables["StackFrames"].items():
    loc = locations.get(dict((a, int(b)) for a, b in _FIELDS.findall(v)).get("file_location_id"),
                        {})
    out[k] = (files.get(loc.get("file_name_id"), ""),
              functions.get(loc.get("function_name_id"), ""))
  return out


def parse_hlo(hlo_text: str) -> dict[str, Instruction]:
  """Instruction name -> `Instruction`, for every instruction of a compiled
  HLO module's text (`jax.stages.Compiled.as_text()`)."""
  lines = hlo_text.splitlines()
  frames = _frames(lines)
  out = {}
  for line in lines:
    m = profile.INSTRUCTION.match(line)
    if not m:
      continue
    name, rhs = m.groups()
    t = profile.OP_TYPE.search(line)
    f = _FRAME_ID.search(line)
    file, function = frames.get(int(f.group(1)), (None, None)) if f else (None, None)
    o = _OP_NAME.search(line)
    out[name] = Instruction(opcode=profile.opcode(rhs), op_type=t.group(1) if t else None,
                            file=file, function=function, op_name=o.group(1) if o else "")
  return out


def classify_instruction(ins: Instruction) -> str:
  """The bucket of one HLO instruction (module docstring)."""
  if ins.op_type:
    for bucket, prefixes in _OP_PREFIXES.items():
      if ins.op_type.startswith(prefixes):
        return bucket
  if ins.opcode == "ragged-dot":
    return GMM
  file = (ins.file or "").replace("\\", "/")
  for bucket, dirs in _OP_DIRS.items():
    if any(d in file for d in dirs):
      return bucket
  if file.endswith(_ATTENTION_FILE) or (file.endswith(_ATTENTION_FRAME[0])
                                         and ins.function == _ATTENTION_FRAME[1]):
    return ATTENTION
  return REST


def _kernel_bucket(name: str) -> str | None:
  """The bucket of a Pallas kernel's event by its name (`gdn_fwd`,
  `tokamax_gdn_tgmm`, with or without the `.N` suffix), or None."""
  base = _SUFFIX.sub("", name.lstrip("%"))
  for bucket, pattern in _KERNEL_PATTERNS:
    if pattern.search(base):
      return bucket
  return None


def classify_name(name: str, instructions: dict[str, Instruction] | None = None) -> str:
  """The bucket of a device event named `name`: its instruction's, when the
  module has one by that name; else by kernel name."""
  if instructions:
    ins = instructions.get(name.lstrip("%"))
    if ins is not None:
      return _by_instruction(name, ins)
  return _kernel_bucket(name) or REST


def _by_instruction(name: str, ins: Instruction) -> str:
  """An instruction's bucket; a kernel whose source frame is in a library
  (splash attention's custom calls: their innermost frame is jax's own
  file, not ours) goes by its kernel name."""
  bucket = classify_instruction(ins)
  if bucket == REST:
    bucket = _kernel_bucket(name) or REST
  return bucket


def event_instruction(e: dict[str, Any], instructions: dict[str, Instruction]) -> str | None:
  """The name of the module's instruction a trace event ran: the one its
  `hlo_op` or `long_name` argument (`%fusion.3 = ...`) or its name names;
  None when none of them is in `instructions`."""
  args = e.get("args") or {}
  long_name = args.get("long_name", "")
  m = re.match(r"^\s*%?([\w.\-]+)\s*=", long_name) if isinstance(long_name, str) else None
  for candidate in (args.get("hlo_op"), m.group(1) if m else None, str(e.get("name", ""))):
    if isinstance(candidate, str) and candidate.lstrip("%") in instructions:
      return candidate.lstrip("%")
  return None


def resolve_event(e: dict[str, Any], instructions: dict[str, Instruction]) -> tuple[str, bool]:
  """(the bucket of a trace event, whether it was attributed): by its
  instruction (`event_instruction`), else by kernel name; not attributed
  when neither finds it (it is then `rest`)."""
  name = event_instruction(e, instructions)
  if name is not None:
    return _by_instruction(name, instructions[name]), True
  bucket = _kernel_bucket(str(e.get("name", "")))
  return (bucket, True) if bucket else (REST, False)


def classify_event(e: dict[str, Any], instructions: dict[str, Instruction]) -> str:
  """The bucket of a trace event (`resolve_event`)."""
  return resolve_event(e, instructions)[0]


def self_times(events: Iterable[dict[str, Any]]) -> list[tuple[dict[str, Any], float]]:
  """(event, its duration minus its children's) for duration events, children
  being the events nested inside it on the same track."""
  by_track = collections.defaultdict(list)
  for e in events:
    by_track[(e.get("pid"), e.get("tid"))].append(e)
  out = []
  for track in by_track.values():
    track.sort(key=lambda e: (float(e.get("ts", 0.0)), -float(e.get("dur", 0.0))))
    stack: list[list[Any]] = []    # [event, end, self time]
    for e in track:
      ts, dur = float(e.get("ts", 0.0)), float(e.get("dur", 0.0))
      while stack and stack[-1][1] <= ts:
        out.append((stack[-1][0], stack[-1][2]))
        stack.pop()
      if stack:
        stack[-1][2] -= min(dur, stack[-1][1] - ts)
      stack.append([e, ts + dur, dur])
    out += [(e, s) for e, _, s in stack]
  return [(e, max(s, 0.0)) for e, s in out]


def device_op_events(events: list[dict[str, Any]], device_substring: str = "TPU"
                     ) -> list[dict[str, Any]]:
  """The duration events of the device's op tracks: threads named "XLA Ops"
  of processes whose name contains `device_substring` (else, on a trace
  without that thread name, the device's threads whose name ends in "Ops")."""
  process, thread = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e.get("pid")] = str(e.get("args", {}).get("name", ""))
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[(e.get("pid"), e.get("tid"))] = str(e.get("args", {}).get("name", ""))
  on_device = [e for e in events
               if e.get("ph") == "X" and device_substring in process.get(e.get("pid"), "")]
  for keep in (lambda t: "XLA Ops" in t, lambda t: t.endswith("Ops")):
    ops = [e for e in on_device if keep(thread.get((e.get("pid"), e.get("tid")), ""))]
    if ops:
      return ops
  return []


def device_split(events: list[dict[str, Any]], hlo_text: str | None = None, *, calls: int = 1,
                 device_substring: str = "TPU") -> dict[str, float] | None:
  """Seconds of device time per bucket for one call, from the trace `events`
  of `calls` calls of the compiled module whose text is `hlo_text`; None
  when the trace has no device op track (not on a TPU).

  The dict has every `BUCKETS` key, "device" (their sum) and "attributed":
  the share of the device time whose events were traced to an instruction
  of the module or a known kernel (low: this trace names its events in a
  way the split does not read, and most of it fell into `rest`)."""
  ops = device_op_events(events, device_substring)
  if not ops:
    return None
  instructions = parse_hlo(hlo_text) if hlo_text else {}
  split = dict.fromkeys(BUCKETS, 0.0)
  attributed = 0.0
  for e, us in self_times(ops):
    bucket, found = resolve_event(e, instructions)
    split[bucket] += us * 1e-6 / calls
    attributed += us * 1e-6 / calls if found else 0.0
  split["device"] = sum(split[b] for b in BUCKETS)
  split["attributed"] = attributed / split["device"] if split["device"] else 0.0
  return split


_UNNAMED = Instruction(opcode="", op_type=None, file=None, function=None)


def _pass_of(op_name: str) -> str:
  """"bwd" for an instruction of a VJP's transpose, "fwd" for one of the
  forward's linearisation, else "" (the optimizer, the loss's glue)."""
  if "transpose(" in op_name:
    return "bwd"
  return "fwd" if "jvp(" in op_name else ""


def top_instructions(events: list[dict[str, Any]], hlo_text: str | None = None, *, n: int = 20,
                     calls: int = 1, device_substring: str = "TPU") -> list[dict[str, Any]] | None:
  """The `n` instructions of the module (or kernels, by event name) with the
  most device time in one call, from the trace `events` of `calls` calls of
  the compiled module whose text is `hlo_text`; None when the trace has no
  device op track (not on a TPU). What `device_split` sums per bucket, listed:
  where a bucket's time goes (`tokamax-gdn train --compare-impls ... --top-ops N`).

  Each row: `instruction`, its `bucket`, `ms` and `share` of the device total
  for one call, `events` per call (an instruction inside a loop runs once per
  iteration), `pass` ("fwd" / "bwd" / "", from JAX's op name), `op` (the
  last part of that name: the jnp operation it came from) and `source` (its
  innermost source frame, file and function)."""
  ops = device_op_events(events, device_substring)
  if not ops:
    return None
  instructions = parse_hlo(hlo_text) if hlo_text else {}
  total = collections.defaultdict(float)
  count = collections.Counter()
  device = 0.0
  for e, us in self_times(ops):
    name = event_instruction(e, instructions) or str(e.get("name", "")).lstrip("%")
    total[name] += us
    count[name] += 1
    device += us
  rows = []
  for name in sorted(total, key=lambda k: -total[k])[:n]:
    # A kernel the module does not name: no op name or source to show.
    ins = instructions.get(name, _UNNAMED)
    file = (ins.file or "").replace("\\", "/")
    rows.append(dict(
        instruction=name, bucket=classify_name(name, instructions),
        ms=total[name] * 1e-3 / calls, share=total[name] / device if device else 0.0,
        events=count[name] / calls, **{"pass": _pass_of(ins.op_name)},
        op=ins.op_name.rsplit("/", 1)[-1],
        source=f"{file.rsplit('/', 1)[-1]}:{ins.function}" if file else ""))
  return rows


def bucket_totals(ops: Iterable[tuple[str, float]],
                  instructions: dict[str, Instruction] | None = None) -> dict[str, float]:
  """Sum of (name, time) pairs per bucket: the classifier on a plain op list
  (a `benchmarks.timing.op_table`'s names and times)."""
  out = dict.fromkeys(BUCKETS, 0.0)
  for name, t in ops:
    out[classify_name(name, instructions)] += t
  return out
