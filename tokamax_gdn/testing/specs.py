"""The numerical contract every implementation is held to against `reference`.

float32: rel-RMS 2e-4 for outputs and 2e-3 for gradients; bf16 (and narrower):
2e-2 (docs/design.md, "Numerical contract"). The conformance suite, `tokamax-gdn
validate` and the op tests measure errors with `rel_rms` and compare them with
`tolerance`.
"""

import jax.numpy as jnp
import numpy as np

# Elements per step of the host's sums: the on-chip tier compares arrays of
# up to 2^28 elements, whose float64 copies at once took gigabytes of host
# memory (and, with several checks side by side, more than the host has).
_CHUNK = 1 << 22


def _float64(x) -> np.ndarray:
  x = np.asarray(x)
  if x.dtype.itemsize < 4:
    # bf16 / f16 / fp8 through float32: numpy's direct cast of ml_dtypes'
    # narrow floats to float64 is several times slower.
    x = x.astype(np.float32)
  return x.astype(np.float64)


def _flat_chunks(*arrays):
  """The arrays (one shape) flattened, step by step: float64 pieces of each."""
  flat = [np.asarray(x).reshape(-1) for x in arrays]
  for lo in range(0, flat[0].size, _CHUNK):
    yield tuple(_float64(x[lo:lo + _CHUNK]) for x in flat)


def rel_rms(actual, expected) -> float:
  """||actual - expected||_2 / max(||expected||_2, tiny), in float64 (0 for empty arrays)."""
  # In numpy: on a TPU, each eager jnp op on a new shape is a compile.
  a, e = np.asarray(actual), np.asarray(expected)
  if a.size == 0 and e.size == 0:
    return 0.0
  if a.shape != e.shape:      # broadcast against each other: at once
    a, e = _float64(a), _float64(e)
    return float(np.sqrt(np.mean((a - e) ** 2)) / max(np.sqrt(np.mean(e**2)), 1e-30))
  num = den = 0.0
  for a64, e64 in _flat_chunks(a, e):
    d = a64 - e64
    num += float(np.dot(d, d))
    den += float(np.dot(e64, e64))
  return float(np.sqrt(num / a.size) / max(np.sqrt(den / a.size), 1e-30))


def all_finite(x) -> bool:
  """Whether every element of `x` is finite (checked piece by piece on the host)."""
  return all(bool(np.isfinite(c).all()) for (c,) in _flat_chunks(x))


def tolerance(dtype, *, grad: bool) -> float:
  """The contract's bound: f32 2e-4 / 2e-3 (grads); bf16 and narrower 2e-2."""
  if jnp.dtype(dtype) == jnp.float32:
    return 2e-3 if grad else 2e-4
  return 2e-2
