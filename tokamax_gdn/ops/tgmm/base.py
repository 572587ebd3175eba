"""Transposed grouped matmul (tgmm): the Op every implementation derives from.

With offsets = cumsum([0, *group_sizes]) and rows_g = [offsets[g], offsets[g+1]):

  out[g] = lhs[rows_g]^T @ rhs[rows_g]        lhs [M, K], rhs [M, N], out [G, K, N]

Rows past sum(group_sizes) are ignored; an empty group gives zeros. Same as
`jax.lax.ragged_dot_general` with a ragged contracting dimension. It is gmm's
weight gradient: for out = gmm(x, w), dw = tgmm(x, dout).

VJP (out[g] = A_g^T B_g with A = lhs, B = rhs restricted to rows_g):
  dlhs[rows_g] = B_g @ dout[g]^T  -> gmm(rhs, dout, transpose_rhs=True)
  drhs[rows_g] = A_g @ dout[g]    -> gmm(lhs, dout)
Both give zeros past sum(group_sizes), as they should.
"""

from collections.abc import Callable
import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jaxtyping import Array, Integer, Shaped  # pylint: disable=g-multiple-import,g-importing-member
from tokamax._src.ops import op
from tokamax._src.ops.ragged_dot import base as ragged_dot_base

from tokamax_gdn.ops import checks
from tokamax_gdn.ops.gmm import base as gmm_base

AbstractArray = gmm_base.AbstractArray
Residuals = None
DIMS = ragged_dot_base.RAGGED_CONTRACTING_DOT_DIM_NUMS


@dataclasses.dataclass(frozen=True)
class Tgmm[C, K](gmm_base.GroupedMatmulOp[C, K]):
  """Transposed grouped matmul. Subclasses implement `_tgmm` (and may set
  `vjp_family`); group-size checks as in `gmm_base.GroupedMatmulOp`."""

  forward_mode_name: ClassVar[str] = "tgmm"

  @staticmethod
  def make_vjp(family: str) -> Callable[..., Any]:
    return tgmm_vjp_fn(family)

  def bind(
      self,
      lhs: Shaped[Array | AbstractArray, "M K"],
      rhs: Shaped[Array | AbstractArray, "M N"],
      group_sizes: Integer[Array | AbstractArray, "G"] | Any = None,
      *,
      preferred_element_type: jax.typing.DTypeLike | None = None,
      return_residuals: bool = False,
      ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers | None = None,
      precision: jax.lax.PrecisionLike = None,
      activation: Any = None,
      group_offset: Any = None,
      manual_axis_type: Any = None,
  ) -> op.BoundArguments:
    """Checks shapes and dtypes once for every backend."""
    del precision, manual_axis_type
    gmm_base.check_compat_kwargs(
        ragged_dot_dimension_numbers=ragged_dot_dimension_numbers,
        activation=activation,
        group_offset=group_offset,
        allowed_dims=(DIMS,),
    )

    def check_m():
      if rhs.shape[0] != lhs.shape[0]:
        raise ValueError(
            f"{checks.describe('rhs', rhs)}: rows M must match `lhs` M={lhs.shape[0]}"
            f" (the ragged contraction); got {rhs.shape[0]}."
        )

    return self._bind_checked(
        lhs, rhs, group_sizes, rhs_rank=2, rhs_layout="[M, N]", check_sizes=check_m,
        num_groups=None, preferred_element_type=preferred_element_type,
        return_residuals=return_residuals,
    )

  def _fwd(
      self,
      lhs: Shaped[Array, "M K"],
      rhs: Shaped[Array, "M N"],
      *,
      group_sizes: Integer[Array, "G"],
      preferred_element_type: jnp.dtype,
      return_residuals: bool,
      config: C,
  ) -> tuple[jax.Array, Residuals]:
    del return_residuals
    (m, k), n, g = lhs.shape, rhs.shape[1], group_sizes.shape[0]
    if 0 in (m, k, n, g):
      # No rows to contract (empty groups give zeros), or an empty output.
      return jnp.zeros((g, k, n), preferred_element_type), None
    return self._tgmm(lhs, rhs, group_sizes, out_dtype=preferred_element_type,
                      config=config), None

  def _tgmm(self, lhs, rhs, group_sizes, *, out_dtype, config) -> jax.Array:
    """The backend's computation on canonical arguments (`_fwd` keeps the annotations):
    no dimension is 0 and `group_sizes` is int32."""
    raise NotImplementedError


def tgmm_vjp_fn(implementation: str):
  """The tgmm VJP with gmm of the `implementation` family (see module docstring)."""

  def vjp(residuals, out, dout, lhs, rhs, *, group_sizes, preferred_element_type):
    del residuals, out, preferred_element_type
    from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top

    gmm_op = registry.get("gmm", implementation)
    return gmm_base.operand_grads(
        lhs, rhs,
        dlhs=lambda: gmm_op(rhs, dout, group_sizes, preferred_element_type=lhs.dtype,
                            transpose_rhs=True),
        drhs=lambda: gmm_op(lhs, dout, group_sizes, preferred_element_type=rhs.dtype))

  return vjp
