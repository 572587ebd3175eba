"""Gated RMSNorm: the Op every implementation derives from.

Over groups of V consecutive elements of the last axis of x and gate
[..., D] (D = H·V; V = weight's length: e.g. a GatedDeltaNet layer's value
heads, [B, T, Hv·V]), each group on its own, with weight [V] (HF's
Qwen3NextRMSNormGated, the layer's output norm, to the cast):

  n = (x · rsqrt(mean_V(x²) + eps)) in float32, cast to x's dtype
  h = weight · n                       (in the promoted dtype of the two)
  y = (h in float32) · silu(gate in float32), cast to x's dtype

The backward, in the symbols above (float32; r = rsqrt(mean_V(x²) + eps),
σ = sigmoid(gate), dy the cotangent of y; the casts' cotangents pass as they
are):

  dh = dy · gate · σ                        dgate = dy · h · σ (1 + gate (1 − σ))
  dweight = Σ_groups dh · n                 dn = dh · weight
  dx = r · (dn − (x r) · mean_V(dn · x r))

Every row is independent: backends see x as [B, N, D] (B the leading axis,
N the rest of the rows; a 2-D x is one batch of N rows) and implement
`_norm`; the analytical backends' VJP Ops implement `_norm_bwd`. The math
on [..., V] groups is `forward` / `backward` here, shared by all of them.
"""

import math
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float  # pylint: disable=g-multiple-import,g-importing-member
from tokamax._src.ops import op

from tokamax_gdn.autotuning import ShippedAutotuningCacheMixin
from tokamax_gdn.ops import autodiff
from tokamax_gdn.ops import checks

AbstractArray = jax.ShapeDtypeStruct | jax.core.ShapedArray


def rows_shape(shape: tuple[int, ...]) -> tuple[int, int, int]:
  """[B, N, D] of an x of `shape` [..., D] (see the module docstring)."""
  if len(shape) >= 3:
    return shape[0], math.prod(shape[1:-1]), shape[-1]
  return 1, math.prod(shape[:-1]), shape[-1]


def rows(x: jax.Array) -> jax.Array:
  """x [..., D] as [B, N, D] (see the module docstring)."""
  return x.reshape(rows_shape(x.shape))


def groups(x: jax.Array, v: int) -> jax.Array:
  """x [..., D] as [..., D / V, V]."""
  return x.reshape(*x.shape[:-1], x.shape[-1] // v, v)


def forward(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(y, r, n) of the module docstring's forward on groups x, gate [..., V]
  (the math every backend shares)."""
  x32 = x.astype(jnp.float32)
  r = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  n = (x32 * r).astype(x.dtype)
  h = weight * n
  y = (h.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
  return y, r, n


def backward(x: jax.Array, gate: jax.Array, weight: jax.Array, dy: jax.Array, eps: float
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dx, dgate, dweight terms) of the module docstring's backward on groups
  [..., V], float32: dweight not yet summed (dh · n, x's shape)."""
  _, r, n = forward(x, gate, weight, eps)
  g32, dy32 = gate.astype(jnp.float32), dy.astype(jnp.float32)
  sig = jax.nn.sigmoid(g32)
  h32 = (weight * n).astype(jnp.float32)
  dh = dy32 * g32 * sig
  dgate = dy32 * h32 * sig * (1.0 + g32 * (1.0 - sig))
  dn = dh * weight.astype(jnp.float32)
  xr = x.astype(jnp.float32) * r
  dx = r * (dn - xr * jnp.mean(dn * xr, axis=-1, keepdims=True))
  return dx, dgate, dh * n.astype(jnp.float32)


class GatedRmsNorm[C, K](autodiff.ReverseModeOnly, ShippedAutotuningCacheMixin,
                         op.Op[Any, jax.Array, None, C, K]):
  """Gated RMSNorm. Subclasses implement `_norm`."""

  forward_mode_name: ClassVar[str] = "gated_rmsnorm"

  def bind(
      self,
      x: Float[Array | AbstractArray, "*R D"],
      gate: Float[Array | AbstractArray, "*R D"],
      weight: Float[Array | AbstractArray, "V"],
      *,
      eps: float = 1e-6,
      return_residuals: bool = False,
  ) -> op.BoundArguments:
    """Checks shapes and dtypes once for every backend."""
    if x.ndim < 1:
      raise ValueError(f"{checks.describe('x', x)}: expected at least one axis ([..., D]).")
    for name, a in (("x", x), ("gate", gate), ("weight", weight)):
      checks.require_float(name, a)
    checks.require_shape("gate", gate, tuple(x.shape), "same as `x` [..., D]")
    checks.require_rank("weight", weight, 1, "[V]")
    if weight.shape[0] < 1 or x.shape[-1] % weight.shape[0]:
      raise ValueError(
          f"{checks.describe('weight', weight)}: its length V must divide `x`'s last axis"
          f" D={x.shape[-1]} (groups of V elements are normalised).")
    if not eps > 0:
      raise ValueError(f"`eps`={eps} must be positive.")
    return super().bind(x, gate, weight, eps=float(eps), return_residuals=return_residuals)

  def _fwd(
      self,
      x: Float[Array, "*R D"],
      gate: Float[Array, "*R D"],
      weight: Float[Array, "V"],
      *,
      eps: float,
      return_residuals: bool,
      config: C,
  ) -> tuple[jax.Array, None]:
    del return_residuals
    if x.size == 0:
      return jnp.zeros(x.shape, x.dtype), None
    y = self._norm(rows(x), rows(gate), weight, eps=eps, config=config)
    return y.astype(x.dtype).reshape(x.shape), None

  def _norm(self, x: Float[Array, "B N D"], gate: Float[Array, "B N D"],
            weight: Float[Array, "V"], *, eps: float, config: C) -> jax.Array:
    """Returns y [B, N, D] (N, D at least 1)."""
    raise NotImplementedError


class GatedRmsNormVjp[C, K](ShippedAutotuningCacheMixin,
                            op.Op[Any, dict[str, jax.Array], None, C, K]):
  """Analytical VJP: subclasses implement `_norm_bwd` on [B, N, D] rows."""

  def _fwd(
      self,
      residuals: None,
      out: jax.Array,
      dout: jax.Array,
      x: Float[Array, "*R D"],
      gate: Float[Array, "*R D"],
      weight: Float[Array, "V"],
      *,
      eps: float,
      return_residuals: bool,
      config: C,
  ) -> tuple[dict[str, jax.Array], None]:
    del residuals, out, return_residuals
    if x.size == 0:
      dx, dgate = jnp.zeros_like(x), jnp.zeros_like(gate)
      dweight = jnp.zeros(weight.shape, jnp.float32)
    else:
      dx, dgate, dweight = self._norm_bwd(rows(x), rows(gate), weight, rows(dout), eps=eps,
                                          config=config)
      dx, dgate = dx.reshape(x.shape), dgate.reshape(gate.shape)
    return dict(x=dx.astype(x.dtype), gate=dgate.astype(gate.dtype),
                weight=dweight.astype(weight.dtype)), None

  def _norm_bwd(self, x: Float[Array, "B N D"], gate: Float[Array, "B N D"],
                weight: Float[Array, "V"], dy: Float[Array, "B N D"], *, eps: float,
                config: C) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (dx, dgate [B, N, D], dweight [V] float32)."""
    raise NotImplementedError
