"""Named workloads of an op (`ArgSpec`), shared by tests, benchmarks and autotuning.

Each op folder has an `arg_specs.py` with `ARG_SPECS: list[ArgSpec]` (as
tokamax keeps its `ArgSpec` with its autotuning code). A spec builds fresh
random inputs (never zeros) from a PRNG key; its tags say what it is for:
- 'conformance': small; the conformance suite checks every implementation on it;
- 'interpret': also small enough for Pallas interpret mode in that suite;
- 'bench': `tokamax-gdn bench`'s default workloads (sized for this CPU machine);
- 'aot': `tokamax-gdn aot`'s default shapes (compiled for TPU generations);
- a model tag ('qwen3_next', 'qwen3_5'): shapes of that model's layer.
"""

from collections.abc import Callable
import dataclasses
from typing import Any

import jax

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

  def abstract(self) -> Args:
    """(args, kwargs) with every array as a `jax.ShapeDtypeStruct` (nothing computed)."""
    static = {}

    def arrays(key):
      leaves, static["tree"] = jax.tree.flatten(self.make(key))
      static["leaves"] = leaves
      return [x for x in leaves if isinstance(x, jax.Array)]

    shaped = iter(jax.eval_shape(arrays, jax.random.key(0)))
    leaves = [next(shaped) if isinstance(x, jax.Array) else x for x in static["leaves"]]
    return jax.tree.unflatten(static["tree"], leaves)
