"""The numerical contract every implementation is held to against `reference`.

float32: rel-RMS 2e-4 for outputs and 2e-3 for gradients; bf16 (and narrower):
2e-2 (docs/design.md, "Numerical contract"). The conformance suite, `tokamax-gdn
validate` and the op tests measure errors with `rel_rms` and compare them with
`tolerance`.
"""

import jax.numpy as jnp
import numpy as np


def _float64(x) -> np.ndarray:
  x = np.asarray(x)
  if x.dtype.itemsize < 4:
    # bf16 / f16 / fp8 through float32: numpy's direct cast of ml_dtypes'
    # narrow floats to float64 is several times slower.
    x = x.astype(np.float32)
  return x.astype(np.float64)


def rel_rms(actual, expected) -> float:
  """||actual - expected||_2 / max(||expected||_2, tiny), in float64 (0 for empty arrays)."""
  # In numpy: on a TPU, each eager jnp op on a new shape is a compile.
  a, e = _float64(actual), _float64(expected)
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
