"""Fresh random inputs for the checks, drawn on the host's CPU.

On a TPU every eager `jax.random` draw, scale and cast of a new shape is a
program compiled for the chip: measured on the chip host, a conformance case
spent about ten compiles on its inputs, a named serving workload up to 15 s
compiling its one drawing program, and one normal draw at T = 32768 took 17 s
to compile. The same draws as one program for the host's CPU compile in a
fraction of that and leave the chip's compiler to the implementations; the
values are the same `jax.random` streams (threefry is defined bit for bit;
a scale through a transcendental, fused in one program, may differ from the
eager one in its last bit).
"""

from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def host_cpu() -> jax.Device | None:
  """The host's CPU device, or None where jax runs without a CPU backend."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


def draw(make: Callable[[jax.Array], Any], seed: int, *, on_host: bool | None = None) -> Any:
  """`make(jax.random.key(seed))`: its arrays computed on the host and placed
  on the default device, every other leaf (sizes, flags) as `make` gave it.

  `make` must draw only from its key (a traced key: it runs under jit).
  `on_host`: None draws as one program on the host's CPU when the default
  device is not the CPU (there `make` runs as it is, eagerly), True always,
  False never.
  """
  cpu = host_cpu()
  if on_host is None:
    on_host = cpu is not None and jax.default_backend() != "cpu"
  if not on_host or cpu is None:
    return make(jax.random.key(seed))
  static = {}

  def arrays(seed):
    leaves, static["tree"] = jax.tree.flatten(make(jax.random.key(seed)))
    static["leaves"] = leaves
    return [x for x in leaves if isinstance(x, jax.Array)]

  with jax.default_device(cpu):
    drawn = jax.jit(arrays)(np.uint32(seed))
  # Through numpy: placed as an eager draw's would be (on the default device,
  # not committed to it).
  placed = iter(jax.device_put([np.asarray(x) for x in drawn]))
  leaves = [next(placed) if isinstance(x, jax.Array) else x for x in static["leaves"]]
  return jax.tree.unflatten(static["tree"], leaves)
