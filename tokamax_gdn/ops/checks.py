"""Argument checks shared by every op's `bind`: errors name the argument and
give the expected vs the given shape (ValueError) or dtype (TypeError)."""

import jax.numpy as jnp


def describe(name: str, x) -> str:
  """"`name` (shape (..), dtype ..)" for error messages."""
  return f"`{name}` (shape {tuple(x.shape)}, dtype {jnp.dtype(x.dtype).name})"


def require_float(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{describe(name, x)} must be a floating-point array.")


def require_rank(name: str, x, rank: int, layout: str) -> None:
  if x.ndim != rank:
    raise ValueError(f"{describe(name, x)}: expected rank {rank} ({layout}).")


def require_shape(name: str, x, expected: tuple[int, ...], what: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{describe(name, x)}: expected shape {tuple(expected)} ({what}).")
