"""Tiling arithmetic shared by the Pallas TPU kernels of every op."""

import jax.numpy as jnp

LANES = 128  # the minor (lane) dimension of a TPU vreg / VMEM tile


def round_up(x: int, multiple: int) -> int:
  """The smallest multiple of `multiple` that is >= x."""
  return -(-x // multiple) * multiple


def sublane_tiling(dtype) -> int:
  """Native second-minor tiling of a dtype in VMEM: 8 (32-bit), 16 (16-bit), 32 (8-bit)."""
  return 32 // max(1, min(4, jnp.dtype(dtype).itemsize))
