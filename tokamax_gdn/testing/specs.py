"""Named workloads shared by tests, benchmarks and autotuning.

Each op folder has an `arg_specs.py` with `ARG_SPECS: list[ArgSpec]`. A spec
builds fresh random inputs (never zeros) from a PRNG key; tags say what the
spec is for: 'conformance' (small, every implementation incl. interpret-mode
kernels), 'bench', 'aot', and a model tag ('qwen3_next', 'qwen3_5').
"""

from collections.abc import Callable
import dataclasses
import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Args = tuple[tuple[Any, ...], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class ArgSpec:
  """A named set of inputs for one op.

  Attributes:
    name: unique within the op, e.g. 'gva_1to2_l2norm_T65'.
    make: key -> (args, kwargs) for the op call (no `implementation`).
    diff_argnames: names of the float arguments (positional or keyword) that
      gradients are checked for.
    tags: what the spec is for (see module docstring).
    vmap_ok: whether the conformance suite may vmap this call over a new
      leading axis of every array argument.
  """

  name: str
  make: Callable[[jax.Array], Args]
  diff_argnames: tuple[str, ...]
  tags: tuple[str, ...] = ("conformance",)
  vmap_ok: bool = True


def arg_specs(op_name: str, tag: str | None = None) -> list[ArgSpec]:
  """The op's specs (from `tokamax_gdn.ops.<op>.arg_specs`), optionally by tag."""
  module = importlib.import_module(f"tokamax_gdn.ops.{op_name}.arg_specs")
  specs = list(module.ARG_SPECS)
  return [s for s in specs if tag is None or tag in s.tags]


def rel_rms(actual, expected) -> float:
  """||actual - expected||_2 / max(||expected||_2, tiny), in float64 (0 for empty arrays)."""
  a = np.asarray(jnp.asarray(actual, jnp.float32), np.float64)
  e = np.asarray(jnp.asarray(expected, jnp.float32), np.float64)
  if a.size == 0 and e.size == 0:
    return 0.0
  num = np.sqrt(np.mean((a - e) ** 2))
  den = np.sqrt(np.mean(e**2))
  return float(num / max(den, 1e-30))


def tolerance(dtype, *, grad: bool) -> float:
  """DESIGN.md's numerical contract: f32 2e-4 / 2e-3 (grads); bf16 2e-2."""
  if jnp.dtype(dtype) == jnp.float32:
    return 2e-3 if grad else 2e-4
  return 2e-2
