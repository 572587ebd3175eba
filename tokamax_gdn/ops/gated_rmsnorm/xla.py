"""Gated RMSNorm in plain JAX with the analytical backward (`base.backward`).

Autodiff of the forward makes XLA write float32 intermediates of x's full
size between fusions (the normalised x, silu(gate), their products), and on
TPU relay them out; the analytical backward recomputes them from x, gate and
dy where they are used. Per-row statistics still cross the TPU's lanes
(a mean over D broadcast back over D), which XLA materialises: the Pallas
kernels keep each block's rows in VMEM instead.
"""

import dataclasses
from typing import Any

import jax.numpy as jnp

from tokamax_gdn.ops.gated_rmsnorm import base


@dataclasses.dataclass(frozen=True, kw_only=True)
class XlaGatedRmsNormVjp(base.GatedRmsNormVjp[Any, Any]):
  """`base.backward`, dweight summed over the rows."""

  def _norm_bwd(self, x, gate, weight, dy, *, eps, config):
    del config
    v = weight.shape[0]
    dx, dgate, dw_terms = base.backward(base.groups(x, v), base.groups(gate, v), weight,
                                        base.groups(dy, v), eps)
    return dx.reshape(x.shape), dgate.reshape(x.shape), jnp.sum(dw_terms, axis=(0, 1, 2))


@dataclasses.dataclass(frozen=True)
class XlaGatedRmsNorm(base.GatedRmsNorm[Any, Any]):
  """`base.forward`; analytical VJP."""

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", XlaGatedRmsNormVjp())

  def _norm(self, x, gate, weight, *, eps, config):
    del config
    v = weight.shape[0]
    return base.forward(base.groups(x, v), base.groups(gate, v), weight, eps)[0].reshape(x.shape)


IMPLEMENTATION = XlaGatedRmsNorm()
