"""The serving op's benchmark programs, and CPU timings of ours against tokamax's.

Implementations (`op_call`): ours by registry name, and three peers:
  `tokamax_xla`   tokamax 0.0.17's `xla` op, its reference (a per-token scan
                  over the pool);
  `vllm`          vLLM TPU's kernel, tpu-inference's GDN v3
                  `fused_conv1d_gdn` at its defaults, where tpu-inference's
                  files are on the path (`integrations.vllm.tpu_inference_kernel`);
  `vllm_dropin`   ours behind vLLM's signature (`integrations.vllm`).
A peer that cannot run here fails when its program is built or compiled; the
benchmarks turn that into a row with the reason.

Programs, each taking both pools donated and returning them, as an engine
calls the op:
- `jitted_step`: one call per program (the host dispatches every call);
- `chained_program`: N calls chained in one program, a `lax.fori_loop` whose
  carry holds the pools (and the last output) from call to call, so that the
  host dispatches once per N calls, as an engine's step that runs every
  layer in one program. The inputs are the same in every iteration: each
  iteration passes them through one `lax.optimization_barrier` with the
  carry, so that XLA cannot hoist the work that depends on them alone (the
  conv of the tokens, the gates, the request metadata) out of the loop.
  `loop_invariant_ops` lists, from a compiled program's HLO, the work done
  outside the loop on the inputs (none, with the barrier).

`run(specs, impls, reps)` (`tokamax-gdn bench --op causal_conv1d_gated_delta_rule`
off a TPU): every implementation is jitted (`jitted_step`) on the same inputs;
rounds are interleaved (one call of each per round) so that load on the
machine hits all alike; the median round time is reported with the ratio
tokamax / ours (> 1: ours is faster). On a TPU the bench's tables are
`on_chip.serving_rows`'.
"""

from collections.abc import Callable
import re
import statistics
import time
from typing import Any

import jax
from jax import lax
from jax.experimental.layout import Format, Layout
import jax.numpy as jnp

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

OP = "causal_conv1d_gated_delta_rule"
TOKAMAX = "tokamax_xla"
VLLM = "vllm"
VLLM_DROPIN = "vllm_dropin"
PEERS = (TOKAMAX, VLLM, VLLM_DROPIN)
# Calls an engine-like program chains (`chained_program`) by default.
CHAIN_CALLS = 32


def _tokamax_xla():
  from tokamax._src.ops.causal_conv1d_gated_delta_rule import api as tokamax_api  # pylint: disable=g-import-not-at-top
  return tokamax_api.IMPLEMENTATIONS["xla"]


def _vllm_convention(kernel):
  """vLLM's `fused_conv1d_gdn` (read_state_indices positional and required)
  called with our op's convention (read_state_indices, read_offsets as
  optional keywords)."""
  def call(*args, read_state_indices=None, read_offsets=None, **static):
    reads = args[10] if read_state_indices is None else read_state_indices
    return kernel(*args, reads, read_offsets, **static)
  return call


def op_call(impl: str, kwargs: dict[str, Any]) -> Callable[..., Any]:
  """`impl`'s call on the benchmarks' split of a spec's arguments:
  fn(conv_pool, rec_pool, rest, arrays) -> ((conv_pool, rec_pool), out),
  `rest` the positional arguments but the pools, `arrays` the keyword arrays;
  the static sizes are `kwargs`'. Raises ValueError for an unknown name,
  ImportError where the `vllm` peer's package is not found."""
  static = {k: v for k, v in kwargs.items() if k in arg_specs.STATIC}
  if impl == TOKAMAX:
    op = _tokamax_xla()
    if not static.get("num_spec_tokens"):
      static.pop("num_spec_tokens", None)
  elif impl in (VLLM, VLLM_DROPIN):
    from tokamax_gdn.integrations import vllm  # pylint: disable=g-import-not-at-top
    op = _vllm_convention(vllm.tpu_inference_kernel() if impl == VLLM
                          else vllm.fused_conv1d_gdn)
  else:
    op = registry.get(OP, impl)

  def step(conv, rec, rest, arrays):
    return op(*rest[:3], conv, rec, *rest[3:], **arrays, **static)

  return step


# Pool layouts a benchmark may ask for: "auto" lets XLA pick the pools'
# layouts for the program (`Layout.AUTO`), and the caller places its pools in
# them once (`jax.device_put(pool, compiled.input_formats...)`), as an engine
# that allocates its pools for its compiled step does; "default" keeps the
# runtime's default layout at the jit boundary. On a TPU the default layout
# of a [slots, W-1, D] bf16 conv pool puts the W-1 axis outermost, and a
# kernel that reads the pool row-major then costs an XLA relayout of the
# whole pool into the call and back out of it.
POOL_LAYOUTS = ("auto", "default")


def check_pool_layout(pool_layout: str) -> None:
  if pool_layout not in POOL_LAYOUTS:
    raise ValueError(f"pool_layout={pool_layout!r}; valid: {POOL_LAYOUTS}")


def _jit(program, pool_layout: str):
  """`program(conv, rec, rest, arrays)` jitted with both pools donated; with
  `pool_layout` "auto" their layouts are XLA's choice for the program (lower
  and compile it, then place the pools in `input_formats`)."""
  check_pool_layout(pool_layout)
  if pool_layout == "default":
    return jax.jit(program, donate_argnums=(0, 1))
  auto = Format(Layout.AUTO)
  return jax.jit(program, donate_argnums=(0, 1), in_shardings=(auto, auto, None, None),
                 out_shardings=((auto, auto), None))


def jitted_step(impl, kwargs, pool_layout: str = "default"):
  """The op as an engine's step, one call per program (`_jit`)."""
  return _jit(op_call(impl, kwargs), pool_layout)


def chained_program(impl, kwargs, calls: int = CHAIN_CALLS, pool_layout: str = "default",
                    tie_inputs: bool = True):
  """`calls` calls of the op chained in one program (module doc): a
  `lax.fori_loop` carrying (conv_pool, rec_pool, out), the pools donated in
  and returned, as `jitted_step`'s; returns the last call's output.
  `tie_inputs` False leaves out the barrier that keeps the per-call work in
  the loop (only to show what XLA then hoists)."""
  if calls < 1:
    raise ValueError(f"calls must be >= 1; got {calls}")
  step = op_call(impl, kwargs)

  def program(conv, rec, rest, arrays):
    out = jax.eval_shape(step, conv, rec, rest, arrays)[1]

    def body(_, carry):
      inputs = (rest, arrays)
      if tie_inputs:
        carry, inputs = lax.optimization_barrier((carry, inputs))
      conv, rec, _ = carry
      (conv, rec), out = step(conv, rec, *inputs)
      return conv, rec, out

    conv, rec, out = lax.fori_loop(0, calls, body,
                                   (conv, rec, jnp.zeros(out.shape, out.dtype)))
    return (conv, rec), out

  return _jit(program, pool_layout)


# HLO opcodes that move or name values rather than compute them. (Copies
# change layouts: on a TPU, of inputs whose default layout is not the one the
# loop takes, e.g. [T, n_v] b and a; an engine's projections produce them in
# the consumer's layout.)
_STRUCTURAL = frozenset({"parameter", "constant", "tuple", "get-tuple-element", "while",
                         "bitcast", "copy", "opt-barrier", "copy-start", "copy-done"})
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*)$")


def _opcode_and_operands(rhs: str) -> tuple[str, list[str]]:
  """(opcode, operand names) of an HLO instruction's right-hand side."""
  if rhs.startswith("("):      # a tuple type: skip to its closing parenthesis
    depth = 0
    for i, ch in enumerate(rhs):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        rhs = rhs[i + 1:].lstrip()
        break
  else:
    rhs = rhs.split(" ", 1)[1] if " " in rhs else ""
  opcode, _, args = rhs.partition("(")
  depth, end = 1, 0
  for end, ch in enumerate(args):
    depth += (ch == "(") - (ch == ")")
    if depth == 0:
      break
  return opcode.strip(), re.findall(r"%([\w.\-]+)", args[:end])


def loop_invariant_ops(hlo_text: str) -> list[str]:
  """The instructions of a compiled program's entry computation that compute
  from its parameters, other than the loop itself and the moves around it
  (tuples, copies into other layouts): the work XLA hoisted out of
  `chained_program`'s loop. Empty when every call's work runs in the loop.
  Constants XLA builds before the loop (masks, iotas) read no parameter and
  are not listed."""
  start = hlo_text.index("\nENTRY ")
  end = hlo_text.find("\n}", start)
  tainted, found = set(), []
  for line in hlo_text[start:end].splitlines()[1:]:
    m = _INSTRUCTION.match(line)
    if not m:
      continue
    name, rhs = m.groups()
    opcode, operands = _opcode_and_operands(rhs)
    if opcode == "parameter" or any(o in tainted for o in operands):
      tainted.add(name)
      if opcode not in _STRUCTURAL:
        found.append(f"{name} ({opcode})")
  return found


def describe(spec) -> str:
  (qkv, *_), kwargs = spec.abstract()
  return (f"T={qkv.shape[0]} Hk={kwargs['n_kq']} Hv={kwargs['n_v']} K={kwargs['d_k']}"
          f" V={kwargs['d_v']} {qkv.dtype}")


def run(specs, impls=("xla", TOKAMAX), reps: int = 5, key=None) -> list[dict[str, Any]]:
  """One row per (spec, implementation): median ms and tokamax's time / this one's."""
  key = jax.random.key(0) if key is None else key
  rows = []
  for spec in specs:
    args, kwargs = spec.make(key)
    arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
    rest = args[:3] + args[5:]
    fns = {impl: jitted_step(impl, kwargs) for impl in impls}
    pools = {impl: None for impl in impls}
    times = {impl: [] for impl in impls}
    errors = {}
    for rnd in range(reps + 1):          # round 0 compiles
      for impl, fn in fns.items():
        if impl in errors:
          continue
        if pools[impl] is None:
          pools[impl] = (args[3].copy(), args[4].copy())
        start = time.perf_counter()
        try:
          pools[impl], out = fn(*pools[impl], rest, arrays)
          jax.block_until_ready((pools[impl], out))
        except Exception as e:  # pylint: disable=broad-exception-caught
          # A peer that cannot run here (vLLM's kernel off a TPU) is a row
          # with the reason, as on the chip.
          errors[impl] = f"{type(e).__name__}: {e}".splitlines()[0][:300]
          continue
        if rnd:
          times[impl].append(time.perf_counter() - start)
    med = {impl: statistics.median(t) * 1e3 for impl, t in times.items() if impl not in errors}
    for impl in impls:
      rows.append(dict(spec=spec.name, shape=describe(spec), impl=impl, ms=med.get(impl),
                       error=errors.get(impl),
                       tokamax_over_this=(med[TOKAMAX] / med[impl]
                                          if TOKAMAX in med and impl in med else None)))
  return rows
