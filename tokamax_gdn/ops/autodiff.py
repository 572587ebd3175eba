"""Forward-mode autodiff of the ops: a clear error that names the op.

Every op is a `tokamax.Op` with a custom VJP (an analytical backward, or a
`custom_vjp` wrapper), and JAX cannot push tangents forward through a
`custom_vjp` function: `jax.jvp` / `jax.jacfwd` fail with a TypeError that
names neither the op nor what to use instead (and under `jax.jit` it is
raised at lowering, far from the call). Reverse mode (`jax.grad`, `jax.vjp`,
`jax.jacrev`) is what the ops support; a JVP rule through the reference math
would give forward mode at the reference's cost, which is not what a user
asking for a fast kernel expects.

Use: `with reverse_mode_only(op_name, args, kwargs): <call the op>`, as the
GDN base Op's `__call__` does.
"""

import contextlib

import jax
from jax._src.interpreters import ad as jax_ad  # pylint: disable=g-direct-jax-src-import

# The message of JAX's TypeError for a custom_vjp function under jax.jvp.
_JAX_JVP_OF_CUSTOM_VJP = "can't apply forward-mode autodiff (jvp) to a custom_vjp function"


class ForwardModeError(TypeError):
  """Forward-mode autodiff (jax.jvp, jax.jacfwd) of an op that has only a VJP."""


def _error(op_name: str) -> ForwardModeError:
  return ForwardModeError(
      f"{op_name} does not support forward-mode autodiff (jax.jvp, jax.jacfwd): it"
      " has a custom reverse-mode VJP. Use jax.grad, jax.vjp or jax.jacrev.")


def _under_jvp(tree) -> bool:
  """Whether an argument is a forward-mode tracer. With direct linearize (the
  default) reverse mode traces with LinearizeTracers, so a JVPTracer means
  jax.jvp / jax.jacfwd; without it reverse mode uses JVPTracers too."""
  if not jax.config.jax_use_direct_linearize:
    return False
  return any(isinstance(x, jax_ad.JVPTracer) for x in jax.tree.leaves(tree))


@contextlib.contextmanager
def reverse_mode_only(op_name: str, *call_args, up_front: bool = True):
  """Raises `ForwardModeError` naming `op_name` for forward-mode autodiff of
  the op called inside the block with `call_args` (any pytrees): up front
  when an argument carries a forward-mode tracer (unless not `up_front`),
  else when JAX's own TypeError comes out of the block."""
  if up_front and _under_jvp(call_args):
    raise _error(op_name)
  try:
    yield
  except TypeError as e:
    if _JAX_JVP_OF_CUSTOM_VJP not in str(e) or isinstance(e, ForwardModeError):
      raise
    raise _error(op_name) from e


class ReverseModeOnly:
  """Mixin for an Op base class: forward-mode autodiff of an implementation
  with a VJP raises `ForwardModeError` naming `forward_mode_name`. One without
  a VJP Op is differentiated by JAX, forward mode included, unless it uses a
  `jax.custom_vjp` inside: then JAX's TypeError becomes the same error."""

  forward_mode_name: str = ""

  def __call__(self, *args, **kwargs):
    with reverse_mode_only(self.forward_mode_name, args, kwargs,
                           up_front=getattr(self, "vjp", None) is not None):
      return super().__call__(*args, **kwargs)
