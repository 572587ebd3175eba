"""Argument checks shared by every op's `bind`: errors name the argument and
give the expected vs the given shape (ValueError) or dtype (TypeError)."""

import jax.numpy as jnp


def describe(name: str, x) -> str:
  """"`name` (shape (..), dtype ..)" for error messages."""
  return f"`{name}` (shape {tuple(x.shape)}, dtype {jnp.dtype(x.dtype).name})"


def require_float(name: str, x) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f"{describe(name, x)} must be a floating-point array.")


def require_same_dtype(**arrays) -> None:
  """TypeError unless the arrays (name=array) share one dtype."""
  dtypes = {jnp.dtype(x.dtype) for x in arrays.values()}
  if len(dtypes) > 1:
    given = ", ".join(f"`{n}` {jnp.dtype(x.dtype).name}" for n, x in arrays.items())
    first, *others = arrays
    raise TypeError(f"{given}: these must share one dtype. Cast them to one first, e.g."
                    f" `{others[0]}.astype({first}.dtype)`.")


def require_float32(name: str, x, why: str) -> None:
  if jnp.dtype(x.dtype) != jnp.float32:
    raise TypeError(f"{describe(name, x)} must be float32 ({why}).")


def require_rank(name: str, x, rank: int, layout: str) -> None:
  if x.ndim != rank:
    raise ValueError(f"{describe(name, x)}: expected rank {rank} ({layout}).")


def require_shape(name: str, x, expected: tuple[int, ...], what: str) -> None:
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{describe(name, x)}: expected shape {tuple(expected)} ({what}).")
