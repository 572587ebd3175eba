"""Grouped matmul (gmm): the Op every implementation derives from.

Rows of `lhs` are split into consecutive groups by `group_sizes`; group g owns
rows [offsets[g], offsets[g + 1]) with offsets = cumsum([0, *group_sizes]):

  out[offsets[g]:offsets[g+1]] = lhs[offsets[g]:offsets[g+1]] @ rhs[g]      (rhs [G, K, N])
  out[offsets[g]:offsets[g+1]] = lhs[offsets[g]:offsets[g+1]] @ rhs[g]^T    (transpose_rhs, rhs [G, N, K])

Rows past sum(group_sizes) are zero. Same as `jax.lax.ragged_dot`.

The checks here are shared with `tgmm` (its base imports them). `bind` also
accepts the keyword arguments `tokamax.ragged_dot` passes to an Op instance
(`ragged_dot_dimension_numbers`, `precision`, `activation`, `group_offset`,
`manual_axis_type`), so any gmm implementation can be handed to
`tokamax.ragged_dot(..., implementation=op)`.
"""

from collections.abc import Callable
import dataclasses
from typing import Any, ClassVar

import jax
from jax.experimental import checkify
import jax.numpy as jnp
from jaxtyping import Array, Integer, Shaped  # pylint: disable=g-multiple-import,g-importing-member
from tokamax._src.ops import op
from tokamax._src.ops.ragged_dot import base as ragged_dot_base

from tokamax_gdn.autotuning import ShippedAutotuningCacheMixin
from tokamax_gdn.ops import autodiff
from tokamax_gdn.ops.checks import describe, require_rank  # pylint: disable=g-importing-member

AbstractArray = jax.ShapeDtypeStruct | jax.core.ShapedArray
Residuals = None

DIMS_PLAIN = ragged_dot_base.DEFAULT_RAGGED_DOT_DIM_NUMS
DIMS_TRANSPOSED_RHS = ragged_dot_base.TRANS_RHS_RAGGED_DOT_DIM_NUMS


def _is_fp8(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 1


def require_operand_dtype(name: str, x) -> None:
  """Floats of any width, int8 and fp8 (8-bit operands are upcast in the matmul)."""
  dt = jnp.dtype(x.dtype)
  if jnp.issubdtype(dt, jnp.floating) or dt == jnp.int8:
    return
  raise TypeError(
      f"{describe(name, x)} must be a floating-point (incl. fp8) or int8 array."
  )


def check_group_sizes(group_sizes, num_groups: int | None) -> None:
  """Integer, rank 1, and (when known) of length G = rhs.shape[0]."""
  if not hasattr(group_sizes, "dtype") or not hasattr(group_sizes, "shape"):
    raise TypeError(
        f"`group_sizes` must be an integer array of shape [G]; got {type(group_sizes).__name__}."
    )
  if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
    raise TypeError(f"{describe('group_sizes', group_sizes)} must be an integer array.")
  if group_sizes.ndim != 1:
    raise ValueError(f"{describe('group_sizes', group_sizes)}: expected rank 1 ([G]).")
  if num_groups is not None and group_sizes.shape[0] != num_groups:
    raise ValueError(
        f"{describe('group_sizes', group_sizes)}: expected shape ({num_groups},)"
        " (one size per group of `rhs`)."
    )


def canonical_group_sizes(group_sizes, *, op_name: str, num_groups: int | None, m: int,
                          checkify_values: bool) -> Any:
  """`group_sizes` as int32 [G], checked; also from a tokamax `GroupSizes` or a list.

  int32 whatever the given integer dtype, so that every implementation's
  running sums of the sizes (the group offsets) cannot overflow (an int8
  cumsum wraps past 127). `checkify_values` adds the opt-in value checks.
  """
  if group_sizes is None:
    raise TypeError(f"{op_name}() missing required argument `group_sizes`.")
  if isinstance(group_sizes, ragged_dot_base.GroupSizes):
    group_sizes = group_sizes.value
  if isinstance(group_sizes, (list, tuple)):
    group_sizes = jnp.asarray(group_sizes, jnp.int32)
  check_group_sizes(group_sizes, num_groups)
  if isinstance(group_sizes, AbstractArray):  # binding abstract arguments (AOT, autotuning)
    return jax.ShapeDtypeStruct(group_sizes.shape, jnp.int32)
  group_sizes = jnp.asarray(group_sizes).astype(jnp.int32)
  if checkify_values:
    checkify.debug_check(jnp.all(group_sizes >= 0), "`group_sizes` has a negative entry.")
    checkify.debug_check(jnp.sum(group_sizes) <= m, "sum(`group_sizes`) exceeds the M rows.")
  return group_sizes


def canonical_out_dtype(lhs, rhs, preferred_element_type) -> jnp.dtype:
  """`preferred_element_type`, else the operands' result type (as `jax.lax.ragged_dot`;
  for fp8 beside a wider float, which JAX does not promote, that float)."""
  if preferred_element_type is not None:
    return jnp.dtype(preferred_element_type)
  try:
    return jnp.dtype(jnp.result_type(lhs.dtype, rhs.dtype))
  except (TypeError, ValueError):  # fp8 has no implicit promotion: fp8 x bf16 -> bf16.
    return compute_dtype(lhs.dtype, rhs.dtype)


def ragged_dot(lhs, rhs, group_sizes, dims, compute_dtype) -> jax.Array:
  """`jax.lax.ragged_dot_general` of lhs and rhs converted to `compute_dtype`,
  accumulated in float32, with the rows that no group covers zero.

  On TPU the ragged dot is a Mosaic kernel that runs one bf16 MXU pass
  whatever `precision` says (f32 operands at HIGHEST lose f32 accuracy, and
  bf16 ones at HIGHEST do not compile: "Bad lhs type"). So float32 operands
  run as three bf16 passes, hi·hi + hi·lo + lo·hi of their bf16 splits (lo·lo
  is below f32's rounding of the sum), on every backend alike; other dtypes
  run one pass at DEFAULT, exact products. The split rounds with
  `reduce_precision`: XLA may drop an f32 -> bf16 -> f32 round trip as
  allowed excess precision (TPU does), which would make every lo piece zero.

  The TPU kernel leaves the output rows past sum(group_sizes) unwritten, and
  a ragged contraction may read the operands' rows past it: both are masked
  here, so that those rows are zero (and the contraction ignores them) as
  the op's contract says, on every backend.
  """
  dot = lambda a, b: jax.lax.ragged_dot_general(
      a, b, group_sizes, ragged_dot_dimension_numbers=dims,
      precision=jax.lax.Precision.DEFAULT, preferred_element_type=jnp.float32)
  lhs, rhs = lhs.astype(compute_dtype), rhs.astype(compute_dtype)
  rows = lambda x: jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes)
  ragged_contraction = dims.lhs_ragged_dimensions[0] in dims.dot_dimension_numbers[0][0]
  if ragged_contraction:
    lhs = jnp.where(rows(lhs), lhs, jnp.zeros((), lhs.dtype))
    rhs = jnp.where(rows(rhs), rhs, jnp.zeros((), rhs.dtype))
  if jnp.dtype(compute_dtype) != jnp.float32:
    out = dot(lhs, rhs)
  else:
    def split(x):
      hi = jax.lax.reduce_precision(x, exponent_bits=8, mantissa_bits=7)
      return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)
    (lh, ll), (rh, rl) = split(lhs), split(rhs)
    out = dot(lh, rh) + (dot(lh, rl) + dot(ll, rh))
  return out if ragged_contraction else jnp.where(rows(out), out, 0.0)


def compute_dtype(lhs_dtype, rhs_dtype) -> jnp.dtype:
  """The dtype both operands are converted to before the matmul (f32 accumulation).

  - int8 / fp8 beside a wider float become that float (exact: every int8 and
    fp8 value is representable in bf16); two 8-bit operands meet in bf16.
  - Floats of different widths (bf16 with f32) meet in the *narrower* one: the
    MXU runs at bf16 rate and the result is as accurate as the bf16 operand
    allows anyway (the bf16 tolerance of the numerical contract applies), as
    XLA's default TPU precision does for such a product.
  - f16 with bf16: f32.
  """
  lhs_dtype, rhs_dtype = jnp.dtype(lhs_dtype), jnp.dtype(rhs_dtype)
  if lhs_dtype == rhs_dtype and lhs_dtype.itemsize > 1:
    return lhs_dtype
  narrow = lambda d: d.itemsize == 1
  if narrow(lhs_dtype) and narrow(rhs_dtype):
    return jnp.dtype(jnp.bfloat16)
  if narrow(lhs_dtype):
    return rhs_dtype
  if narrow(rhs_dtype):
    return lhs_dtype
  if lhs_dtype.itemsize != rhs_dtype.itemsize:
    return min(lhs_dtype, rhs_dtype, key=lambda d: d.itemsize)
  return jnp.dtype(jnp.float32)


def check_compat_kwargs(
    *, ragged_dot_dimension_numbers, activation, group_offset, allowed_dims
) -> jax.lax.RaggedDotDimensionNumbers | None:
  """The `tokamax.ragged_dot` keywords we can honour; NotImplementedError otherwise."""
  if activation is not None:
    raise NotImplementedError("`activation` is not supported by tokamax_gdn gmm/tgmm.")
  if group_offset is not None:
    raise NotImplementedError("`group_offset` is not supported by tokamax_gdn gmm/tgmm.")
  if ragged_dot_dimension_numbers is not None and ragged_dot_dimension_numbers not in allowed_dims:
    raise NotImplementedError(
        f"ragged_dot_dimension_numbers={ragged_dot_dimension_numbers} is not supported;"
        f" supported: {list(allowed_dims)}."
    )
  return ragged_dot_dimension_numbers


@dataclasses.dataclass(frozen=True)
class GroupedMatmulOp[C, K](autodiff.ReverseModeOnly, ShippedAutotuningCacheMixin,
                           op.Op[Any, jax.Array, Residuals, C, K]):
  """What the gmm and tgmm Ops share.

  Group sizes with a negative entry or a sum over M give undefined results
  (implementations differ). `checkify_group_sizes=True` adds checks that
  report them under `jax.experimental.checkify.checkify`, as tokamax's
  ragged_dot does. `vjp_family` names the implementation whose gmm and tgmm
  compute the VJP (`make_vjp`); None: JAX autodiff of the forward.
  """

  _: dataclasses.KW_ONLY
  checkify_group_sizes: bool = False
  vjp_family: ClassVar[str | None] = None

  @staticmethod
  def make_vjp(family: str) -> Callable[..., Any]:
    raise NotImplementedError

  def __post_init__(self):
    if self.vjp is None and self.vjp_family is not None:
      object.__setattr__(self, "vjp", self.make_vjp(self.vjp_family))

  def _bind_checked(self, lhs, rhs, group_sizes, *, rhs_rank: int, rhs_layout: str,
                    check_sizes: Callable[[], None], num_groups: int | None,
                    preferred_element_type, return_residuals: bool,
                    **kwargs) -> op.BoundArguments:
    """What gmm's and tgmm's `bind` share once the ragged_dot keywords are
    checked: operand ranks ([M, K] lhs) and dtypes, `check_sizes()` (how the
    operands' sizes must agree), `group_sizes` and the output dtype; then
    tokamax's bind of the canonical arguments (and the op's own `kwargs`)."""
    require_rank("lhs", lhs, 2, "[M, K]")
    require_rank("rhs", rhs, rhs_rank, rhs_layout)
    require_operand_dtype("lhs", lhs)
    require_operand_dtype("rhs", rhs)
    check_sizes()
    group_sizes = canonical_group_sizes(
        group_sizes, op_name=self.forward_mode_name, num_groups=num_groups, m=lhs.shape[0],
        checkify_values=self.checkify_group_sizes)
    return super().bind(
        lhs, rhs, group_sizes=group_sizes,
        preferred_element_type=canonical_out_dtype(lhs, rhs, preferred_element_type),
        return_residuals=return_residuals, **kwargs)


@dataclasses.dataclass(frozen=True)
class Gmm[C, K](GroupedMatmulOp[C, K]):
  """Grouped matmul. Subclasses implement `_gmm` (and may set `vjp_family`)."""

  forward_mode_name: ClassVar[str] = "gmm"

  @staticmethod
  def make_vjp(family: str) -> Callable[..., Any]:
    return gmm_vjp_fn(family)

  def bind(
      self,
      lhs: Shaped[Array | AbstractArray, "M K"],
      rhs: Shaped[Array | AbstractArray, "G K N"],
      group_sizes: Integer[Array | AbstractArray, "G"] | Any = None,
      *,
      preferred_element_type: jax.typing.DTypeLike | None = None,
      transpose_rhs: bool = False,
      return_residuals: bool = False,
      # Keywords `tokamax.ragged_dot` passes to an Op instance.
      ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers | None = None,
      precision: jax.lax.PrecisionLike = None,
      activation: Any = None,
      group_offset: Any = None,
      manual_axis_type: Any = None,
      zero_initialize: bool = False,
  ) -> op.BoundArguments:
    """Checks shapes and dtypes once for every backend."""
    # Every implementation accumulates in float32 with full-precision f32 matmuls.
    del precision, manual_axis_type, zero_initialize
    dims = check_compat_kwargs(
        ragged_dot_dimension_numbers=ragged_dot_dimension_numbers,
        activation=activation,
        group_offset=group_offset,
        allowed_dims=(DIMS_PLAIN, DIMS_TRANSPOSED_RHS),
    )
    if dims is not None:
      transpose_rhs = dims == DIMS_TRANSPOSED_RHS
    k_axis = 2 if transpose_rhs else 1

    def check_k():
      if rhs.shape[k_axis] != lhs.shape[1]:
        layout = "[G, N, K] (transpose_rhs=True)" if transpose_rhs else "[G, K, N]"
        raise ValueError(
            f"{describe('rhs', rhs)}: contraction size K must match `lhs` K={lhs.shape[1]};"
            f" got {rhs.shape[k_axis]} in rhs layout {layout}."
        )

    return self._bind_checked(
        lhs, rhs, group_sizes, rhs_rank=3,
        rhs_layout="[G, N, K]" if transpose_rhs else "[G, K, N]", check_sizes=check_k,
        num_groups=rhs.shape[0], preferred_element_type=preferred_element_type,
        transpose_rhs=bool(transpose_rhs), return_residuals=return_residuals,
    )

  # `tokamax.ragged_dot(..., implementation=x)` iterates over `x` unless it is
  # a string; acting as a one-element sequence of itself lets a gmm Op be
  # passed there directly, not only as `[op]`.
  def __iter__(self):
    yield self

  def __len__(self) -> int:
    return 1

  def _fwd(
      self,
      lhs: Shaped[Array, "M K"],
      rhs: Shaped[Array, "G K N"],
      *,
      group_sizes: Integer[Array, "G"],
      preferred_element_type: jnp.dtype,
      transpose_rhs: bool,
      return_residuals: bool,
      config: C,
  ) -> tuple[jax.Array, Residuals]:
    del return_residuals
    m, k = lhs.shape
    n = rhs.shape[1] if transpose_rhs else rhs.shape[2]
    if 0 in (m, k, n, rhs.shape[0]):
      # No rows, no columns, nothing to contract or no groups: the result is
      # all zeros (rows in no group are zero), for every backend alike.
      return jnp.zeros((m, n), preferred_element_type), None
    out = self._gmm(lhs, rhs, group_sizes, out_dtype=preferred_element_type,
                    transpose_rhs=transpose_rhs, config=config)
    return out, None

  def _gmm(self, lhs, rhs, group_sizes, *, out_dtype, transpose_rhs, config) -> jax.Array:
    """The backend's computation on canonical arguments (`_fwd` keeps the annotations):
    no dimension is 0 and `group_sizes` is int32."""
    raise NotImplementedError


def gmm_vjp_fn(implementation: str):
  """The gmm VJP, computed with gmm / tgmm of the `implementation` family.

  dlhs = gmm(dout, rhs, transpose_rhs=not transpose_rhs)
  drhs = tgmm(lhs, dout)  [G, K, N],  or tgmm(dout, lhs) [G, N, K] when transposed.
  """

  def vjp(residuals, out, dout, lhs, rhs, *, group_sizes, preferred_element_type,
          transpose_rhs):
    del residuals, out, preferred_element_type
    from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top

    gmm_op = registry.get("gmm", implementation)
    tgmm_op = registry.get("tgmm", implementation)

    def drhs():
      if transpose_rhs:
        return tgmm_op(dout, lhs, group_sizes, preferred_element_type=rhs.dtype)
      return tgmm_op(lhs, dout, group_sizes, preferred_element_type=rhs.dtype)

    return operand_grads(
        lhs, rhs,
        dlhs=lambda: gmm_op(dout, rhs, group_sizes, preferred_element_type=lhs.dtype,
                            transpose_rhs=not transpose_rhs),
        drhs=drhs)

  return vjp


def operand_grads(lhs, rhs, *, dlhs: Callable[[], jax.Array],
                  drhs: Callable[[], jax.Array]) -> dict[str, jax.Array]:
  """The VJP's {"lhs": dlhs(), "rhs": drhs()} of gmm and tgmm, with zeros for an
  integer (int8) operand, which has no gradient."""
  return {name: grad() if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros_like(x)
          for name, x, grad in (("lhs", lhs, dlhs), ("rhs", rhs, drhs))}
