"""Validation run: every implementation vs `reference` at a model preset's shapes.

Used by `tokamax-gdn validate`. Inputs are fresh random arrays shaped like one
GatedDeltaNet layer of the preset (heads, head dims, conv width); gmm/tgmm use
an MoE-like [tokens, hidden] x [8 experts, hidden, hidden // 4] problem.

Each row runs in milliseconds: nearly all of the command's time is compiling,
so `run` builds everything first and concurrently, then runs. Every program
(each op's reference loss-and-grads, each implementation's forward and its
gradients as two programs, the layer through each implementation) is lowered
from the inputs' shapes alone
(`jax.eval_shape` of the case) and compiled ahead of time in a thread pool
(XLA compiles outside the GIL); the random inputs, whose eager ops are small
compiles of their own, are made in the same pool. The main thread then runs
the compiled programs and compares them in row order.

The random cotangents of the gradient checks are arguments too, drawn with
the inputs (in numpy: no compile): drawn inside a program, as
`conformance.loss_and_grads` does from a key, they cost the TPU compiler
seconds per program (its code generation for the RNG and the backward it
feeds), for each implementation of the op again.

An implementation's forward and gradients are separate programs, compiled
side by side: one program compiles its kernels one after another, and the
Pallas GDN's three (forward, states pass, backward) were the longest compile
of the command. The gradients' program keeps what of the forward its
backward needs (the Pallas GDN's backward needs none of its forward kernel);
its row's time is both programs', one after the other.

The lowerings take turns (`_Turns`), in the order the tasks start (likely
longest compile first): lowering is Python and holds the GIL, so lowerings
that run at once share it, and the longest one (the Pallas GDN gradients',
tracing three kernels) would end about when all of them have, delaying the
longest compile by the others' lowering time.
"""

import concurrent.futures
import contextlib
import dataclasses
import functools
import os
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from tokamax_gdn import autotuning
from tokamax_gdn import config
from tokamax_gdn import progress as progress_lib
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs
from tokamax_gdn.testing import conformance
from tokamax_gdn.testing import specs as specs_lib

LAYER = "layer:gated_deltanet"
# The programs of an op implementation other than the reference, by the
# suffix of their task labels (`_Group.parts`).
FORWARD, GRADIENTS = " forward", " gradients"
# With progress on, how often the compile phase names what is still compiling,
# so one long compile does not look like a hang.
STALL_REPORT_S = 15.0


def _gdn_case(cfg, batch, seq_len, key):
  args, kwargs = random_inputs(key, b=batch, t=seq_len, hk=cfg.num_k_heads,
                               hv=cfg.num_v_heads, dk=cfg.head_k_dim,
                               dv=cfg.head_v_dim, gate=True, segments=2)
  kwargs["use_qk_l2norm"] = True
  shape = (f"B{batch} T{seq_len} Hk{cfg.num_k_heads} Hv{cfg.num_v_heads}"
           f" K{cfg.head_k_dim} V{cfg.head_v_dim}")
  diff = ("query", "key", "value", "g", "beta", "initial_state", "a_log", "dt_bias")
  return args, kwargs, diff, shape


def _conv_case(cfg, batch, seq_len, key):
  d, w = cfg.conv_dim, cfg.conv_kernel_size
  k1, k2, k3 = jax.random.split(key, 3)
  x = jax.random.normal(k1, (batch, seq_len, d), jnp.float32)
  weight = jax.random.normal(k2, (d, w), jnp.float32) * w**-0.5
  h0 = jax.random.normal(k3, (batch, w - 1, d), jnp.float32)
  kwargs = dict(initial_state=h0, output_final_state=True)
  return (x, weight), kwargs, ("x", "weight", "initial_state"), f"B{batch} T{seq_len} D{d} W{w}"


def _group_sizes(key, m, groups):
  cuts = jnp.sort(jax.random.randint(key, (groups - 1,), 0, m + 1))
  edges = jnp.concatenate([jnp.zeros((1,), cuts.dtype), cuts, jnp.full((1,), m, cuts.dtype)])
  return jnp.diff(edges).astype(jnp.int32)


def _gmm_case(cfg, batch, seq_len, key):
  m, k, n, g = batch * seq_len, cfg.hidden_size, max(cfg.hidden_size // 4, 8), 8
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32)
  rhs = jax.random.normal(k2, (g, k, n), jnp.float32) * k**-0.5
  return (lhs, rhs, _group_sizes(k3, m, g)), {}, ("lhs", "rhs"), f"M{m} K{k} N{n} G{g}"


def _tgmm_case(cfg, batch, seq_len, key):
  m, k, n, g = batch * seq_len, cfg.hidden_size, max(cfg.hidden_size // 4, 8), 8
  k1, k2, k3 = jax.random.split(key, 3)
  lhs = jax.random.normal(k1, (m, k), jnp.float32)
  rhs = jax.random.normal(k2, (m, n), jnp.float32)
  return (lhs, rhs, _group_sizes(k3, m, g)), {}, ("lhs", "rhs"), f"M{m} K{k} N{n} G{g}"


CASES = {
    "gated_delta_rule": _gdn_case,
    "causal_conv1d": _conv_case,
    "gmm": _gmm_case,
    "tgmm": _tgmm_case,
}


def _runnable(impl_name: str, interpret: bool) -> str | None:
  """None if runnable here, else why not."""
  if impl_name == "pallas_mosaic_tpu" and not config.on_tpu() and not interpret:
    return "skipped: no TPU (add --interpret)"
  return None


_ARRAY = object()   # where an array leaf goes back in `_join`


def _split(tree) -> tuple[list, Any]:
  """The array leaves of `tree`, and the rest of it (static leaves such as
  `output_final_state=True`) to put them back with `_join`. The arrays are the
  compiled programs' arguments: nothing is baked in as a constant, so a program
  can be compiled before its inputs exist."""
  leaves, treedef = jax.tree.flatten(tree)
  arrays = [x for x in leaves if isinstance(x, jax.Array)]
  return arrays, (treedef, [_ARRAY if isinstance(x, jax.Array) else x for x in leaves])


def _join(arrays, structure):
  treedef, leaves = structure
  it = iter(arrays)
  return jax.tree.unflatten(treedef, [next(it) if x is _ARRAY else x for x in leaves])


def _shapes(make, key) -> tuple[list, Any]:
  """A ShapeDtypeStruct per array of `make(key)`, and its structure (`_split`),
  from tracing `make`: nothing is computed."""
  box = {}

  def arrays(k):
    out, box["structure"] = _split(make(k))
    return out

  return jax.eval_shape(arrays, key), box["structure"]


def _leaves(tree):
  return [x for x in jax.tree.leaves(tree) if x is not None]


def _finite(x) -> bool:
  """In numpy: an eager jnp op would compile once per shape, on the main thread."""
  return bool(np.all(np.isfinite(np.asarray(x, np.float32))))


@dataclasses.dataclass
class _Group:
  """One op (or the layer): its inputs as shapes, and what each implementation
  runs on them. Everything here is known without computing anything."""
  name: str
  make: Callable[[jax.Array], Any]        # key -> the inputs (eager)
  program: Callable[[str, str], Callable]  # (implementation, part) -> fn(arguments)
  compare: Callable[..., dict]            # (impl, result, expected) -> row
  abstract: list                          # a ShapeDtypeStruct per program argument
  structure: Any                          # of the inputs' arrays, from `_split`
  # A ShapeDtypeStruct per output leaf whose random float32 cotangent is a
  # program argument: `abstract` is the inputs' arrays, then these.
  cotangents: list = dataclasses.field(default_factory=list)
  # An implementation's programs, by the suffixes of their task labels ("":
  # its only one), and how their {part: (output, ms)} make the (result, ms)
  # that `compare` takes.
  parts: Callable[[str], tuple[str, ...]] = lambda impl_name: ("",)
  combine: Callable[[dict], Any] = lambda results: results[""]


def _op_group(op_name, make_case, cfg, batch, seq_len, key) -> _Group:
  """Traces the case (no compute) for its shapes and the call's structure. The
  reference's program is its loss and gradients, as in the conformance suite;
  another implementation's are its forward (the plain call) and the
  gradients of that loss, apart (module docstring)."""
  static = {}

  def make(k):
    args, kwargs, static["diff_names"], static["shape"] = make_case(cfg, batch, seq_len, k)
    return args, kwargs

  abstract, structure = _shapes(make, key)
  diff_names, shape = static["diff_names"], static["shape"]
  dtype = conformance.lowest_float_dtype(*_join(abstract, structure))
  ref = registry.get(op_name, "reference")
  n_inputs = len(abstract)

  def outputs(arrays):
    args, kwargs = _join(arrays, structure)
    return _leaves(ref(*args, **kwargs))

  # The reference's output leaves (tracing only), a cotangent each.
  cotangents = [jax.ShapeDtypeStruct(x.shape, jnp.float32)
                for x in jax.eval_shape(outputs, abstract)]

  def program(impl_name, part=""):
    impl = registry.get(op_name, impl_name)

    def loss_and_grads(arrays):
      args, kwargs = _join(arrays[:n_inputs], structure)
      spec = autotuning.ArgSpec(name=op_name, make=lambda _: (args, kwargs),
                               diff_argnames=diff_names)
      diff, call = conformance.split_diff(spec, ref, args, kwargs)
      if part == FORWARD:
        return call(impl, diff)
      out, grads = conformance.loss_and_grads(impl, call, diff, cotangents=arrays[n_inputs:])
      return grads if part == GRADIENTS else (out, grads)
    return loss_and_grads

  def parts(impl_name):
    return ("",) if impl_name == "reference" else (GRADIENTS, FORWARD)

  def combine(results):
    if "" in results:
      return results[""]
    (out, fwd_ms), (grads, grad_ms) = results[FORWARD], results[GRADIENTS]
    return (out, grads), fwd_ms + grad_ms

  def compare(impl_name, result, expected):
    ((out, grads), ms), ((want, want_grads), _) = result, expected
    fwd_err = max(specs_lib.rel_rms(a, e) for a, e in zip(_leaves(out), _leaves(want)))
    grad_err = max(specs_lib.rel_rms(grads[n], want_grads[n]) for n in want_grads)
    finite = all(_finite(x) for x in _leaves((out, grads)))
    ok = (finite and fwd_err <= specs_lib.tolerance(dtype, grad=False)
          and grad_err <= specs_lib.tolerance(dtype, grad=True))
    return dict(op=op_name, implementation=impl_name, shape=shape,
                fwd_rel_rms=f"{fwd_err:.2e}", grad_rel_rms=f"{grad_err:.2e}",
                fwd_bwd_ms=f"{ms:.1f}", status="PASS" if ok else "FAIL")

  return _Group(op_name, make, program, compare, abstract + cotangents, structure, cotangents,
                parts, combine)


def _layer_group(cfg, batch, seq_len, key) -> _Group:
  """The whole layer, forward only, with random parameters and input."""
  from tokamax_gdn import layers as layer  # pylint: disable=g-import-not-at-top

  def make(k):
    kp, kx = jax.random.split(k)
    return layer.init_params(kp, cfg), jax.random.normal(kx, (batch, seq_len, cfg.hidden_size),
                                                         jnp.float32)

  abstract, structure = _shapes(make, key)

  def program(impl_name, part=""):
    del part   # one program: the forward

    def forward(arrays):
      params, x = _join(arrays, structure)
      return layer.gated_deltanet(params, x, cfg, implementation=impl_name)
    return forward

  def compare(impl_name, result, expected):
    (y, ms), (want, _) = result, expected
    err = specs_lib.rel_rms(y, want)
    ok = _finite(y) and err <= specs_lib.tolerance(jnp.float32, grad=False)
    return dict(op=LAYER, implementation=impl_name,
                shape=f"B{batch} T{seq_len} hidden{cfg.hidden_size}",
                fwd_rel_rms=f"{err:.2e}", grad_rel_rms="-", fwd_bwd_ms=f"{ms:.1f} (fwd)",
                status="PASS" if ok else "FAIL")

  return _Group(LAYER, make, program, compare, abstract, structure)


def _random_cotangents(shapes, seed: int = 0) -> list:
  """Standard normal float32 arrays of these shapes, drawn in numpy (an eager
  `jax.random.normal` would be one more compile per shape)."""
  rng = np.random.default_rng(seed)
  return [jnp.asarray(rng.standard_normal(s.shape, np.float32)) for s in shapes]


def _make_inputs(group: _Group, key) -> list:
  """The group's program arguments, computed (in a worker thread): its input
  arrays, then its cotangents."""
  arrays, structure = _split(group.make(key))
  if structure[0] != group.structure[0]:
    raise ValueError(f"{group.name}: inputs {structure[0]} do not match their shapes "
                     f"{group.structure[0]}")
  return jax.block_until_ready(arrays + _random_cotangents(group.cotangents))


class _Turns:
  """Turns to hold, one at a time, in the order `next` hands them out.

  For the lowerings of `run`'s tasks, handed out in the order the pool starts
  the tasks (a thread pool starts them first in, first out, so every earlier
  turn's task has started and will end its turn). A lowering holds the GIL
  nearly throughout: in turns, each compile starts as soon as its own
  lowering is done, the first tasks' (the longest compiles) first, where
  lowerings at once would share the GIL and the longest would end last.
  """

  def __init__(self):
    self._cond = threading.Condition()
    self._now = 0      # the turn being held or next to be
    self._issued = 0
    self._closed = False

  def close(self) -> None:
    """Ends the order: every turn waiting or to come is held at once. For
    when tasks that hold earlier turns will never run (cancelled on Ctrl-C),
    so that no worker waits for them forever."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()

  @contextlib.contextmanager
  def _turn(self, number: int):
    with self._cond:
      self._cond.wait_for(lambda: self._closed or self._now == number)
    try:
      yield
    finally:   # also when the lowering raises: the next turn is not held up
      with self._cond:
        self._now += 1
        self._cond.notify_all()

  def next(self):
    """The next turn, a context manager to hold it."""
    self._issued += 1
    return self._turn(self._issued - 1)


@dataclasses.dataclass(frozen=True)
class Program:
  """One program `run` compiles: `fn(arguments)`, arguments shaped as
  `abstract` (a ShapeDtypeStruct each), of `implementation`."""

  label: str            # "<op or layer>/<implementation><part>"
  implementation: str
  fn: Callable[[list], Any]
  abstract: list

  def lower(self, abstract: list | None = None):
    """`jax.jit(fn).lower` on `abstract` (default: the program's own), in the
    implementation's execution context: interpret mode is a per-thread flag
    read while tracing, so it is set in the thread that lowers (compiling
    reads it no more)."""
    with conformance.execution_context(self.implementation):
      return jax.jit(self.fn).lower(self.abstract if abstract is None else abstract)


def _compile(program: Program, turn=None):
  """One program, lowered from shapes (in `turn`, a context manager, if
  given) and compiled."""
  # The turn outermost: whatever raises, it passes on.
  with turn if turn is not None else contextlib.nullcontext():
    lowered = program.lower()
  return lowered.compile()


def _run_timed(compiled, arrays, impl_name: str):
  """The program's output, and the time of a second, warm call in ms (the
  first call pays one-off costs such as transfers and allocations)."""
  with conformance.execution_context(impl_name):
    out = jax.block_until_ready(compiled(arrays))
    start = time.perf_counter()
    jax.block_until_ready(compiled(arrays))
  return out, (time.perf_counter() - start) * 1e3


def _available_cpus() -> int:
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def _build_all(tasks: dict[str, Callable], workers: int,
               progress: bool) -> dict[str, concurrent.futures.Future]:
  """Runs every task in a pool of `workers` threads (1: one after another, in
  order); returns label -> its finished Future. A task's exception stays in its
  Future, for its rows to report."""
  bar = progress_lib.bar(total=len(tasks), desc="validate: compile", disable=not progress)
  pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="validate")
  try:
    futures = {label: pool.submit(fn) for label, fn in tasks.items()}
    pending = set(futures.values())
    start = last_report = time.monotonic()
    while pending:
      timeout = max(0.1, last_report + STALL_REPORT_S - time.monotonic())
      done, pending = concurrent.futures.wait(
          pending, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)
      bar.update(len(done))
      now = time.monotonic()
      if progress and pending and now - last_report >= STALL_REPORT_S:
        last_report = now
        running = [label for label, f in futures.items() if f in pending and f.running()]
        # tqdm.write keeps a terminal bar intact; elsewhere it is a plain print.
        tqdm.tqdm.write(f"validate: still compiling after {now - start:.0f} s: "
                        f"{', '.join(running)}", file=sys.stderr)
  finally:
    # On Ctrl-C, what has not started never starts (a running compile cannot
    # be stopped); otherwise every task is done and this returns at once.
    pool.shutdown(wait=False, cancel_futures=True)
  bar.close()
  return futures


def _fail_row(group_name, impl_name, e: Exception) -> dict:
  return dict(op=group_name, implementation=impl_name, shape="-", fwd_rel_rms="-",
              grad_rel_rms="-", fwd_bwd_ms="-",
              status=f"FAIL ({type(e).__name__}: {str(e)[:160]})")


def _plan(interpret: bool):
  """Every (op or layer, implementation) row, and those runnable here."""
  plan = [(op_name, impl_name) for op_name in CASES
          for impl_name in registry.implementations(op_name)]
  plan += [(LAYER, n) for n in registry.implementations("gated_delta_rule")
           if n in registry.implementations("causal_conv1d")]
  return plan, [(g, i) for g, i in plan if _runnable(i, interpret) is None]


def _groups(cfg, batch: int, seq_len: int, key, runnable) -> dict[str, "_Group | Exception"]:
  """Shapes and programs of every group with a row to run (tracing only)."""
  groups: dict[str, _Group | Exception] = {}
  for name in dict.fromkeys(g for g, _ in runnable):
    try:
      groups[name] = (_layer_group(cfg, batch, seq_len, key) if name == LAYER
                      else _op_group(name, CASES[name], cfg, batch, seq_len, key))
    except Exception as e:  # pylint: disable=broad-except
      groups[name] = e
  return groups


def _programs(groups, runnable) -> list[tuple[str, list[Program]]]:
  """Per group that was built, its programs, in the order `run` compiles them.

  Likely longest first, so that no long task starts last: the groups whose
  programs hold a GatedDeltaNet (the op's chunked scans, and the layer)
  before the rest; in each group the implementations' gradients (the
  backward kernels), their forwards, then its reference (every row of the
  group needs it; the `reference` row runs the program its group is checked
  against, so that is compiled once). Among implementations, `xla` first:
  at validate's short lengths its float32 programs (HIGHEST-precision
  products, each a fusion of many passes) compile longer than the Pallas
  kernels, which take their small grids' form there
  (`pallas_mosaic_tpu_common.small_grid`)."""
  out = []
  for name in sorted(groups, key=lambda n: n not in ("gated_delta_rule", LAYER)):
    group = groups[name]
    if not isinstance(group, _Group):
      continue
    impls = [i for g, i in runnable if g == name and i != "reference"]
    parts = sorted(((i, p) for i in impls for p in group.parts(i)),
                   key=lambda program: (program[1] != GRADIENTS, program[0] != "xla"))
    parts += [("reference", p) for p in group.parts("reference")]
    out.append((name, [Program(f"{name}/{i}{p}", i, group.program(i, p), group.abstract)
                       for i, p in parts]))
  return out


def programs(cfg, *, seq_len: int = 64, batch: int = 1, interpret: bool = False
             ) -> list[Program]:
  """Every program `run` compiles for these shapes, in its order (a timing
  tool compiles them one by one: `tools/compile_times.py`)."""
  _, runnable = _plan(interpret)
  groups = _groups(cfg, batch, seq_len, jax.random.key(0), runnable)
  return [p for _, progs in _programs(groups, runnable) for p in progs]


def run(cfg, *, seq_len: int = 64, batch: int = 1, interpret: bool = False,
        progress: bool = True, workers: int | None = None) -> list[dict]:
  """Runs every check; returns one row per (op, implementation) and layer.

  `workers`: threads that compile (and make the inputs) at once; default one per
  available CPU, at most one per task; 1 compiles one program after another. A
  row whose inputs, compile or run raise is a FAIL row; the others still run.
  """
  plan, runnable = _plan(interpret)
  key = jax.random.key(0)
  groups = _groups(cfg, batch, seq_len, key, runnable)

  # Each group's programs (`_programs`' order), then its inputs. The lowerings
  # take turns in this order (`_Turns`).
  tasks = {}
  turns = _Turns()
  for name, progs in _programs(groups, runnable):
    tasks |= {p.label: functools.partial(_compile, p, turns.next()) for p in progs}
    tasks[f"{name} inputs"] = functools.partial(_make_inputs, groups[name], key)
  workers = max(1, min(workers or _available_cpus(), len(tasks)))
  try:
    built = _build_all(tasks, workers, progress)
  finally:
    turns.close()   # a task cancelled on Ctrl-C never takes its turn

  rows = []
  expected: dict[str, Any] = {}   # per group: the reference's (output, ms), or its exception
  for group_name, impl_name in progress_lib.bar(plan, desc="validate: run",
                                                disable=not progress):
    why = _runnable(impl_name, interpret)
    if why is not None:
      rows.append(dict(op=group_name, implementation=impl_name, shape="-", fwd_rel_rms="-",
                       grad_rel_rms="-", fwd_bwd_ms="-", status=why))
      continue
    try:
      group = groups[group_name]
      if isinstance(group, Exception):
        raise group
      arrays = built[f"{group_name} inputs"].result()
      run_ = lambda impl: group.combine({  # pylint: disable=cell-var-from-loop
          p: _run_timed(built[f"{group_name}/{impl}{p}"].result(), arrays, impl)
          for p in group.parts(impl)})
      if group_name not in expected:
        try:
          expected[group_name] = run_("reference")
        except Exception as e:  # pylint: disable=broad-except
          expected[group_name] = e
      if isinstance(expected[group_name], Exception):
        raise expected[group_name]
      result = expected[group_name] if impl_name == "reference" else run_(impl_name)
      rows.append(group.compare(impl_name, result, expected[group_name]))
    except Exception as e:  # pylint: disable=broad-except
      rows.append(_fail_row(group_name, impl_name, e))
  return rows
