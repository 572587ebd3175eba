"""The numerical contract every implementation is held to against `reference`.

float32: rel-RMS 2e-4 for outputs and 2e-3 for gradients; bf16 (and narrower):
2e-2 (README, "Numerical contract"). The conformance suite, `tokamax-gdn
validate` and the op tests measure errors with `rel_rms` and compare them with
`tolerance`.
"""

import jax.numpy as jnp
import numpy as np


def rel_rms(actual, expected) -> float:
  """||actual - expected||_2 / max(||expected||_2, tiny), in float64 (0 for empty arrays)."""
  # In numpy: on a TPU, each eager jnp op on a new shape is a compile.
  a = np.asarray(actual).astype(np.float64)
  e = np.asarray(expected).astype(np.float64)
  if a.size == 0 and e.size == 0:
    return 0.0
  num = np.sqrt(np.mean((a - e) ** 2))
  den = np.sqrt(np.mean(e**2))
  return float(num / max(den, 1e-30))


def tolerance(dtype, *, grad: bool) -> float:
  """The contract's bound: f32 2e-4 / 2e-3 (grads); bf16 and narrower 2e-2."""
  if jnp.dtype(dtype) == jnp.float32:
    return 2e-3 if grad else 2e-4
  return 2e-2
