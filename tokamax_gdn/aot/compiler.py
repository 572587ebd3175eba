"""Compile for a real TPU generation on a CPU-only machine (through libtpu).

`compile_for(target, fn, *arg_specs)` lowers and compiles `fn` for one chip
of the target's topology, which runs Mosaic's real passes: bad block shapes,
layouts and VMEM overflow fail here as they would on the chip. The
`CompileReport` has the compiled memory sizes and, when cycle estimates are
on, the compiler's static cycle estimate per kernel and XLA fusion (the
static LLO profile; 0 or absent for kernels with inner pipelines).

The cycle dump is configured through LIBTPU_INIT_ARGS, which libtpu reads once
per process, and it makes compiles slower and sometimes aborts the process
(an LLO_CHECK in libtpu). So estimates come from a child process:
`compile_in_child(target, builder, kwargs)` compiles the cases a builder
function returns there and brings back one `ChildResult` per case; a libtpu
abort loses only the cases not yet reported. `enable_cycle_estimates()` turns
the dump on in this process instead (before its first topology).

Rooflines: `TpuGeneration.peak_flops_per_cycle` / `hbm_bytes_per_cycle`
(`tokamax_gdn.config`) were measured with this estimator on the kernels of
`calibration_cases` (`calibrate(target)` re-measures them), so
`roofline_cycles(...)` is on the estimator's own scale.
"""

from collections.abc import Callable, Iterator, Sequence
import atexit
import contextlib
import dataclasses
import functools
import glob
import importlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
# This module only compiles: several processes may load libtpu at once (without
# it, a second one fails on libtpu's multi-process lockfile).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # pylint: disable=g-import-not-at-top
from jax.experimental import pallas as pl  # pylint: disable=g-import-not-at-top
from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
from jax.experimental.layout import Format, Layout  # pylint: disable=g-import-not-at-top
from jax.experimental.pallas import tpu as pltpu  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from tokamax import config as tokamax_config  # pylint: disable=g-import-not-at-top

from tokamax_gdn import config  # pylint: disable=g-import-not-at-top

_DUMP_FLAG = "--xla_jf_dump_static_llo_profile_to="
# libtpu's LLO text dump (every pass of every compile, ~2 GiB for the GDN
# layer's step at T=512): its per-bundle utilization files give each
# kernel's VLIW slot use (`bundle_units`).
_LLO_DIR_FLAG = "--xla_jf_dump_to="
_LLO_TEXT_FLAG = "--xla_jf_dump_llo_text=true"
_UNITS_GLOB = "*-final_hlo-static-per-bundle-utilization.txt"
_CHILD_LINE = "TOKAMAX_GDN_AOT "
_cycle_dir: str | None = None
_units_dir: str | None = None


def enable_cycle_estimates(dump_dir: str | None = None) -> str | None:
  """Asks libtpu to dump static cycle estimates; call before any compile.

  Returns the dump folder, or None if libtpu was already initialised without
  it in this process (then `CompileReport.kernel_cycles` stays empty).

  The dump changes what fits: with it XLA reserves VMEM of its own ("HLO
  temp 46 MiB, 0% utilization" next to the GDN backward on tpu7x at T=1024
  and 4096, which then fails with 65-67 of 64 MiB where it compiles without
  the dump). Take cycles from short lengths (as the `aot` report does) and
  judge VMEM and memory from compiles without it.
  """
  global _cycle_dir, _units_dir
  if _cycle_dir is not None:
    return _cycle_dir
  args = os.environ.get("LIBTPU_INIT_ARGS", "")
  if _LLO_DIR_FLAG in args and _LLO_TEXT_FLAG in args:
    _units_dir = args.split(_LLO_DIR_FLAG, 1)[1].split()[0]
  if _DUMP_FLAG in args:
    _cycle_dir = args.split(_DUMP_FLAG, 1)[1].split()[0]
    return _cycle_dir
  if _topology.cache_info().currsize:
    return None
  if dump_dir is None:
    # Ours: removed when the process exits (a dump is ~0.7 MiB per compile).
    dump_dir = tempfile.mkdtemp(prefix="tokamax_gdn_llo_")
    atexit.register(shutil.rmtree, dump_dir, ignore_errors=True)
  _cycle_dir = dump_dir
  os.environ["LIBTPU_INIT_ARGS"] = f"{args} {_DUMP_FLAG}{_cycle_dir}".strip()
  return _cycle_dir


@functools.lru_cache(maxsize=None)
def _topology(target: str):
  gen = config.TPU_GENERATIONS[target]
  return topologies.get_topology_desc(topology_name=gen.topology, platform="tpu")


def target_mesh(target: str, num_devices: int = 1, axis_names: Sequence[str] = ("x",),
                shape: Sequence[int] | None = None) -> Mesh:
  """A mesh over `num_devices` chips of `target` (v5e, v6e, v5p, tpu7x)."""
  if target not in config.TPU_GENERATIONS:
    raise ValueError(f"Unknown target {target!r}; valid: {sorted(config.TPU_GENERATIONS)}")
  devices = _topology(target).devices
  if num_devices > len(devices):
    raise ValueError(f"{target} topology has {len(devices)} devices, asked for {num_devices}")
  shape = tuple(shape) if shape is not None else (num_devices,)
  return Mesh(np.array(devices[:num_devices]).reshape(shape), tuple(axis_names))


def spec(mesh: Mesh, shape: Sequence[int], dtype, pspec: P = P()) -> jax.ShapeDtypeStruct:
  """An abstract argument placed on `mesh` with partition spec `pspec`."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, pspec))


@dataclasses.dataclass
class CompileReport:
  """What one AOT compile tells: memory sizes and per-kernel cycle estimates."""

  target: str
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  kernel_cycles: dict[str, int]
  # Pallas kernels in the optimised program: name -> number of calls.
  pallas_calls: dict[str, int] = dataclasses.field(default_factory=dict)
  # Pallas kernel -> `bundle_units` of its schedule, with the LLO text dump on
  # (`compile_in_child(units=True)`).
  kernel_units: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
  # Temporaries in host memory (what a remat policy offloads).
  host_temp_bytes: int = 0

  def as_row(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _snapshot(d: str | None, pattern: str = "*static_llo_profile*") -> dict[str, int]:
  """Dump file -> modification time: a recompile of a kernel rewrites its file."""
  if not d or not os.path.isdir(d):
    return {}
  return {p: os.stat(p).st_mtime_ns for p in glob.glob(os.path.join(d, pattern))}


def _written_since(d: str | None, before: dict[str, int],
                   pattern: str = "*static_llo_profile*") -> list[str]:
  """Files of `_snapshot(d, pattern)` new or rewritten since `before`."""
  return [p for p, mtime in _snapshot(d, pattern).items() if before.get(p) != mtime]


def bundle_units(path: str) -> dict[str, float]:
  """One kernel's VLIW schedule from libtpu's per-bundle utilization file:
  "bundles" (its static length; a grid loop's body counted once) and, per
  unit (MXU, XLU, VALU, VPOP, EUP, VLOAD, VSTORE, ...; the file's own names),
  the share of its slots the schedule fills (ops / (slots per bundle ×
  bundles)). A kernel whose busiest unit is far below 1 is bound by latency
  or by the mix of units, not by one of them."""
  with open(path) as f:
    text = f.read()
  head, _, rows = text.partition("== UTILIZATION:")
  lines = [ln.split() for ln in head.splitlines() if ln.strip() and not ln.startswith("==")]
  names = [n.rstrip(",") for n in lines[0]]
  slots = [int(x) for x in lines[1]]
  sums, bundles = [0] * len(names), 0
  for ln in rows.splitlines():
    parts = ln.split()
    if len(parts) == len(names):
      bundles += 1
      sums = [a + int(b) for a, b in zip(sums, parts)]
  out = {"bundles": float(bundles)}
  out.update({n: (v / (c * bundles) if bundles and c else 0.0)
              for n, v, c in zip(names, sums, slots)})
  return out


def _read_units(paths, kernels) -> dict[str, dict[str, float]]:
  out = {}
  for p in sorted(paths):
    m = re.match(r"\d+-(.+?)-\d+-final_hlo", os.path.basename(p))
    name = kernel_name(m.group(1)) if m else None
    if name in kernels:
      out[name] = bundle_units(p)
  return out


def kernel_name(dump_name: str) -> str:
  """`gdn_fwd_scan.1_TPU v6 lite_...` (a dump file's stem) -> `gdn_fwd_scan`."""
  return re.sub(r"\.\d+$", "", re.sub(r"_TPU.*$", "", dump_name))


_PALLAS_CALL = re.compile(r"^\s*(?:ROOT\s+)?%([\w-]+?)(?:\.\d+)?\s*=.*"
                          r'custom_call_target="tpu_custom_call"', re.M)


def pallas_calls(hlo_text: str) -> dict[str, int]:
  """Pallas TPU kernels called in an (optimised) HLO module's text, by name.

  A Pallas call's instruction is named after its kernel (`%gdn_fwd.1 =
  custom-call(...)`). Counts what survives XLA's optimisations: a kernel
  whose outputs are dead is gone from the compiled program.
  """
  out: dict[str, int] = {}
  for name in _PALLAS_CALL.findall(hlo_text):
    out[name] = out.get(name, 0) + 1
  return out


def copies(hlo_text: str, array: str) -> list[str]:
  """The copy instructions of an (optimised) HLO module's text whose result
  is `array`, an HLO array type without its layout ("bf16[65,3,512]"): the
  relayouts XLA put around a call, e.g. of a pool whose layout at the jit
  boundary is not the one a kernel takes."""
  pattern = re.compile(r"= %s\{[^}]*\} copy\(" % re.escape(array))
  return [line for line in hlo_text.splitlines() if pattern.search(line)]


def _read_cycles(paths) -> dict[str, int]:
  out = {}
  for p in sorted(paths):
    with open(p) as f:
      text = f.read()
    m = re.search(r"estimated_cycles:\s*(\d+)", text)
    name = os.path.basename(p).split("_static_llo_profile")[0]
    out[name] = int(m.group(1)) if m else 0
  return out


@contextlib.contextmanager
def on_target(mesh: Mesh):
  """Abstract mesh (so ops see the chip) + tokamax cross-compilation."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tokamax_config.cross_compile(True):
    yield


def compile_for(target: str, fn: Callable[..., Any], *arg_specs,
                mesh: Mesh | None = None, **static_kwargs) -> CompileReport:
  """Compiles `fn(*arg_specs, **static_kwargs)` for `target`; raises on failure.

  `arg_specs` are `jax.ShapeDtypeStruct`s, typically from `spec(mesh, ...)`;
  plain (shape, dtype) tuples are placed replicated on one chip.
  """
  mesh = mesh or target_mesh(target)
  args = [a if isinstance(a, jax.ShapeDtypeStruct) else spec(mesh, *a) for a in arg_specs]
  before = _snapshot(_cycle_dir)
  before_units = _snapshot(_units_dir, _UNITS_GLOB)
  # A function may name arguments to donate (`fn.aot_donate_argnums`): the
  # serving op's pools, updated in place as an engine calls it.
  donate = getattr(fn, "aot_donate_argnums", ())
  layouts = {}
  if getattr(fn, "aot_auto_layouts", False):
    # Arguments and results in the layouts XLA picks for the program, as
    # arrays inside a model are (a jit boundary's own defaults can differ
    # from what the computation reads, and XLA then adds copies no model runs).
    layouts = dict(in_shardings=tuple(Format(Layout.AUTO, a.sharding) for a in args),
                   out_shardings=Format(Layout.AUTO))
  with on_target(mesh):
    compiled = jax.jit(functools.partial(fn, **static_kwargs),
                       donate_argnums=donate, **layouts).lower(*args).compile()
  mem = compiled.memory_analysis()
  calls = pallas_calls(compiled.as_text())
  return CompileReport(
      target=target,
      temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
      argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
      output_bytes=int(getattr(mem, "output_size_in_bytes", 0)),
      kernel_cycles=_read_cycles(_written_since(_cycle_dir, before)),
      pallas_calls=calls,
      host_temp_bytes=int(getattr(mem, "host_temp_size_in_bytes", 0)),
      kernel_units=_read_units(_written_since(_units_dir, before_units, _UNITS_GLOB), calls),
  )


def clear_cycle_dumps() -> None:
  """Removes the dump folder's contents (between runs in one process)."""
  if _cycle_dir and os.path.isdir(_cycle_dir):
    shutil.rmtree(_cycle_dir)
    os.makedirs(_cycle_dir)


# ------------------------------------------------------------ child process
# A case a builder returns: (label, fn, abstract args placed on the mesh).
Case = tuple[str, Callable[..., Any], Sequence[jax.ShapeDtypeStruct]]


@dataclasses.dataclass
class ChildResult:
  """One case compiled in a child: its report, or why there is none."""

  label: str
  report: CompileReport | None
  error: str | None = None


def compile_cases(target: str, cases: Sequence[Case], mesh: Mesh) -> Iterator[ChildResult]:
  """Compiles each (label, fn, arg_specs) case for `target` in this process,
  yielding its `ChildResult` in turn (a failed compile: its exception's first
  line as `error`). What `compile_in_child`'s child runs."""
  for label, fn, arg_specs in cases:
    try:
      yield ChildResult(label, compile_for(target, fn, *arg_specs, mesh=mesh))
    except Exception as e:  # pylint: disable=broad-exception-caught
      yield ChildResult(label, None, f"{type(e).__name__}: {str(e).splitlines()[0]}")


def compile_in_child(target: str, builder: str, kwargs: dict[str, Any] | None = None, *,
                     cycles: bool = True, timeout: float | None = None,
                     num_devices: int = 1, units: bool = False) -> list[ChildResult]:
  """Compiles, in a fresh Python process, the cases `builder` returns.

  Args:
    target: TPU generation (`config.TPU_GENERATIONS`).
    builder: "package.module:function", called there as
      `function(mesh, **kwargs) -> [(label, fn, arg_specs)]` with a mesh
      ("x") of the first `num_devices` devices of `target` (2 on tpu7x: the
      two TensorCores of one chip); the arguments should be placed on it.
    kwargs: JSON-serialisable keyword arguments for the builder.
    cycles: turn the static cycle dump on in the child.
    timeout: seconds before the child is killed (its finished cases are kept).
    num_devices: devices in the builder's mesh.
    units: with `cycles`, libtpu's LLO text dump on too, for each report's
      `kernel_units` (slower; gigabytes of files, removed when it is done).

  Returns:
    One `ChildResult` per case, in the builder's order. A case that failed to
    compile has its exception's first line as `error`; cases lost to a crash
    of the child (libtpu aborts on some compiles with the dump on) have the
    crash's reason.
  """
  request = json.dumps(dict(target=target, builder=builder, kwargs=kwargs or {}, cycles=cycles,
                            num_devices=num_devices))
  cmd = [sys.executable, "-c", "from tokamax_gdn.aot import compiler; compiler._child_main()"]
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
  # The child's cycle dump lives in a folder of ours, removed here even when
  # libtpu aborts the child (its own exit handlers would not run).
  dump = tempfile.mkdtemp(prefix="tokamax_gdn_llo_") if cycles else None
  if dump is not None:
    args = " ".join(a for a in env.get("LIBTPU_INIT_ARGS", "").split()
                    if not a.startswith((_DUMP_FLAG, _LLO_DIR_FLAG, _LLO_TEXT_FLAG)))
    if units:
      args += f" {_LLO_DIR_FLAG}{os.path.join(dump, 'llo')} {_LLO_TEXT_FLAG}"
    env["LIBTPU_INIT_ARGS"] = f"{args} {_DUMP_FLAG}{dump}".strip()
  try:
    proc = subprocess.run(cmd, input=request, capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)
    stdout, stderr, why = proc.stdout, proc.stderr, f"exit code {proc.returncode}"
  except subprocess.TimeoutExpired as e:
    decode = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
    stdout, stderr, why = decode(e.stdout), decode(e.stderr), f"timed out after {timeout} s"
  finally:
    if dump is not None:
      shutil.rmtree(dump, ignore_errors=True)
  labels, done = [], {}
  for line in stdout.splitlines():
    if not line.startswith(_CHILD_LINE):
      continue
    msg = json.loads(line[len(_CHILD_LINE):])
    if "labels" in msg:
      labels = msg["labels"]
    else:
      report = CompileReport(**msg["report"]) if msg["report"] else None
      done[msg["label"]] = ChildResult(msg["label"], report, msg["error"])
  if not labels:
    raise RuntimeError(f"AOT child for {builder} failed before compiling ({why}):"
                       f" {_crash_reason(stderr)}")
  crash = _crash(stderr, why)
  return [done.get(label, ChildResult(label, None, crash)) for label in labels]


# libtpu's start-up chatter on a machine without TPU chips: not a reason.
_STARTUP_NOISE = ("WARNING", "E0000", "=== Source Location", "learning/", "Failed to find host",
                  "I0000")


# Where libtpu's static cycle estimator lives: an abort there is the
# estimate's, not the compile's (the kernel may compile and run on a chip).
_ESTIMATOR_SOURCE = "static_llo_profile"
ESTIMATOR_ABORTED = "no cycle estimate: libtpu's static estimator aborted"


def _crash_reason(stderr: str) -> str:
  lines = [ln.strip() for ln in stderr.splitlines()
           if ln.strip() and not ln.lstrip().startswith(_STARTUP_NOISE)]
  checks = [ln for ln in lines if "Check failed" in ln]
  return (checks[0] if checks else " | ".join(lines[-3:]) or "no output")[:300]


def _crash(stderr: str, why: str) -> str:
  """What the cases a child died on show: an abort in libtpu's estimator
  (`_ESTIMATOR_SOURCE`) as a missing estimate, anything else as the child's
  death; either with the reason from its stderr."""
  reason = _crash_reason(stderr)
  if _ESTIMATOR_SOURCE in stderr:
    return (f"{ESTIMATOR_ABORTED} (the compile itself may succeed: time it on a chip):"
            f" {reason} (child process: {why})")
  return f"child process died ({why}): {reason}"


def _child_main() -> None:
  """The child side of `compile_in_child`: request on stdin, one line per case out."""
  request = json.loads(sys.stdin.read())
  if request["cycles"]:
    enable_cycle_estimates()
  module, function = request["builder"].split(":")
  builder = getattr(importlib.import_module(module), function)
  mesh = target_mesh(request["target"], request["num_devices"])
  cases = builder(mesh, **request["kwargs"])

  def emit(msg):
    print(_CHILD_LINE + json.dumps(msg), flush=True)

  emit(dict(labels=[label for label, _, _ in cases]))
  for res in compile_cases(request["target"], cases, mesh):
    emit(dict(label=res.label, report=res.report.as_row() if res.report else None,
              error=res.error))


# ------------------------------------------------------------ roofline
def dense_matmul(x, y, *, tm: int, tk: int, tn: int):
  """A plain tiled Pallas matmul x [M, K] @ y [K, N] (the MXU reference kernel)."""
  m, k = x.shape
  n = y.shape[1]

  def kernel(x_ref, y_ref, o_ref, acc_ref):
    @pl.when(pl.program_id(2) == 0)
    def _():
      acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], y_ref[...], preferred_element_type=jnp.float32)

    @pl.when(pl.program_id(2) == pl.num_programs(2) - 1)
    def _():
      o_ref[...] = acc_ref[...].astype(o_ref.dtype)

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(m // tm, n // tn, k // tk),
      in_specs=[pl.BlockSpec((tm, tk), lambda i, j, kk: (i, kk)),
                pl.BlockSpec((tk, tn), lambda i, j, kk: (kk, j))],
      out_specs=pl.BlockSpec((tm, tn), lambda i, j, kk: (i, j)),
      scratch_shapes=[pltpu.VMEM((tm, tn), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=100 << 20),
      name="dense_matmul",
  )(x, y)


def copy(x, *, rows: int):
  """A plain Pallas copy of x [M, N] in [rows, N] blocks (the HBM reference kernel)."""
  m, n = x.shape

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]

  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(m // rows,),
      in_specs=[pl.BlockSpec((rows, n), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((rows, n), lambda i: (i, 0)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=48 << 20),
      name="hbm_copy",
  )(x)


# The calibration kernels: a 4096^3 bf16 matmul and a 64 MiB bf16 copy; the best
# tiling of each is the generation's peak. Searched on v5e, v6e, tpu7x and v5p:
# 1024^3 matmul tiles were the best (512x1024x1024, 1024x512x1024 and
# 512x2048x1024 2-20 % slower; 1024x2048x512 within 0.1 %), copies speed up
# with the block size up to 4 MiB (2048 rows) or more.
_MATMUL_SHAPE = (4096, 4096, 4096)
_MATMUL_TILES = ((1024, 1024, 1024),)
_COPY_SHAPE = (32768, 1024)
_COPY_ROWS = (2048, 4096)


def calibration_cases(mesh: Mesh) -> list[Case]:
  """The kernels the per-generation peaks are measured on (a `compile_in_child` builder)."""
  bf16 = jnp.bfloat16
  m, k, n = _MATMUL_SHAPE
  out = [(f"dense_matmul {tm}x{tk}x{tn}",
          functools.partial(dense_matmul, tm=tm, tk=tk, tn=tn),
          [spec(mesh, (m, k), bf16), spec(mesh, (k, n), bf16)]) for tm, tk, tn in _MATMUL_TILES]
  out += [(f"hbm_copy {rows}", functools.partial(copy, rows=rows),
           [spec(mesh, _COPY_SHAPE, bf16)]) for rows in _COPY_ROWS]
  return out


def calibrate(target: str) -> dict[str, float]:
  """Measures `target`'s peak FLOP/cycle and HBM bytes/cycle with the estimator.

  Compiles `calibration_cases` in a child with the cycle dump on: the best
  matmul tiling's 2·M·K·N FLOPs over its estimate is the MXU peak, the best
  copy's bytes read and written over its estimate the HBM rate. Tilings that
  do not compile or get no estimate are left out.
  """
  best = dict(dense_matmul=0.0, hbm_copy=0.0)
  work = dict(dense_matmul=2 * math.prod(_MATMUL_SHAPE), hbm_copy=2 * 2 * math.prod(_COPY_SHAPE))
  for r in compile_in_child(target, "tokamax_gdn.aot.compiler:calibration_cases"):
    kind = r.label.split()[0]
    cycles = [c for name, c in (r.report.kernel_cycles if r.report else {}).items()
              if kernel_name(name) == kind and c]
    if cycles:
      best[kind] = max(best[kind], work[kind] / cycles[0])
  if not all(best.values()):
    raise RuntimeError(f"no cycle estimate on {target} for {[k for k, v in best.items() if not v]}")
  return dict(peak_flops_per_cycle=best["dense_matmul"], hbm_bytes_per_cycle=best["hbm_copy"])


def roofline_cycles(target: str, flops: float, hbm_bytes: float) -> dict[str, float]:
  """MXU floor, HBM floor and their max (the roofline), in estimator cycles."""
  gen = config.TPU_GENERATIONS[target]
  if gen.peak_flops_per_cycle is None or gen.hbm_bytes_per_cycle is None:
    raise ValueError(f"{target} has no calibrated peaks (see tokamax_gdn.aot.calibrate)")
  mxu = flops / gen.peak_flops_per_cycle
  hbm = hbm_bytes / gen.hbm_bytes_per_cycle
  return dict(mxu_cycles=mxu, hbm_cycles=hbm, floor_cycles=max(mxu, hbm))
