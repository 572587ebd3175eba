"""Compile for a real TPU generation on a CPU-only machine (through libtpu).

`compile_for(target, fn, *arg_specs)` lowers and compiles `fn` for one chip
of the target's topology, which runs Mosaic's real passes: bad block shapes,
layouts and VMEM overflow fail here as they would on the chip. The report has
the compiled memory sizes and, per Pallas kernel, the compiler's static cycle
estimate (the static LLO profile; 0 or absent for kernels with inner
pipelines, where the compiler gives none).

The cycle dump is configured through LIBTPU_INIT_ARGS, which libtpu reads once
per process: `enable_cycle_estimates()` must run before the first topology is
made (the CLI does this; tests that only need compile/memory don't).
"""

from collections.abc import Callable, Sequence
import contextlib
import dataclasses
import functools
import glob
import os
import re
import shutil
import tempfile
from typing import Any

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # pylint: disable=g-import-not-at-top
from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from tokamax import config as tokamax_config  # pylint: disable=g-import-not-at-top

from tokamax_gdn import config  # pylint: disable=g-import-not-at-top

_DUMP_FLAG = "--xla_jf_dump_static_llo_profile_to="
_cycle_dir: str | None = None


def enable_cycle_estimates(dump_dir: str | None = None) -> str | None:
  """Asks libtpu to dump static cycle estimates; call before any compile.

  Returns the dump folder, or None if libtpu was already initialised without
  it in this process (then `CompileReport.kernel_cycles` stays empty).
  """
  global _cycle_dir
  if _cycle_dir is not None:
    return _cycle_dir
  args = os.environ.get("LIBTPU_INIT_ARGS", "")
  if _DUMP_FLAG in args:
    _cycle_dir = args.split(_DUMP_FLAG, 1)[1].split()[0]
    return _cycle_dir
  if _topology.cache_info().currsize:
    return None
  _cycle_dir = dump_dir or tempfile.mkdtemp(prefix="tokamax_gdn_llo_")
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

  def as_row(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _snapshot(d: str | None) -> set[str]:
  if not d or not os.path.isdir(d):
    return set()
  return set(glob.glob(os.path.join(d, "*static_llo_profile*")))


def _read_cycles(paths: set[str]) -> dict[str, int]:
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
  with on_target(mesh):
    compiled = jax.jit(functools.partial(fn, **static_kwargs)).lower(*args).compile()
  mem = compiled.memory_analysis()
  return CompileReport(
      target=target,
      temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
      argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
      output_bytes=int(getattr(mem, "output_size_in_bytes", 0)),
      kernel_cycles=_read_cycles(_snapshot(_cycle_dir) - before),
  )


def clear_cycle_dumps() -> None:
  """Removes the dump folder's contents (between CLI runs in one process)."""
  if _cycle_dir and os.path.isdir(_cycle_dir):
    shutil.rmtree(_cycle_dir)
    os.makedirs(_cycle_dir)
