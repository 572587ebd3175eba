"""Gated delta rule: the Op every implementation derives from.

Recurrence (per batch b and value head h, reading key head h // (Hv // Hk)):

  S_t = exp(g_t) * S_{t-1}
  S_t = S_t + beta_t * k_t (v_t - k_t^T S_t)^T          S_t: [K, V], float32
  o_t = scale * S_t^T q_t

with q, k L2-normalised first (x / sqrt(sum x^2 + 1e-6)) when `use_qk_l2norm`,
g_t = -exp(a_log) * softplus(g_raw + dt_bias) when `a_log`/`dt_bias` are
given, and beta_t = sigmoid(b_t) of logits b when `use_beta_sigmoid`.
`segment_ids` resets S to zero where the id changes (t > 0); the first
segment starts from `initial_state`.

Per-segment states: with `segment_ids`, `initial_state` may be [B, N, Hv, K, V]:
segment n of row b (the n-th run of equal ids, counted from 0) starts from
initial_state[b, n], and the final state is [B, N, Hv, K, V], segment n's own
end state (zeros where a row has fewer than N segments). Segments past the
N-th start from zero and their end states are not returned. Chunked backends
run this on a re-layout where every segment starts at a chunk boundary
(`segments.align_segments`; docs/gdn_math.md, "Per-segment states").

Split of work (one module per concept):
- `GatedDeltaRule.bind` (here) validates and canonicalises once, for all backends.
- `prologue` (l2norm + gate activation + the chunked log-decay floor + beta's
  sigmoid) is pointwise per token; it is shared and differentiated by autodiff in
  `GatedDeltaRuleVjp`, or run (and differentiated) inside the core where the
  backend says so (`prologue_in_core`).
- Backends implement `_core_fwd` (and, for an analytical backward, a
  `GatedDeltaRuleVjp` subclass implementing `_core_bwd`) on the prepared
  q, k (input dtype, normalised), v, log-decay (float32) and beta.
- `segments`: segment starts, the state each segment starts from, the aligned
  layout of per-segment states.
- `isolation`: `SegmentGuard` wraps the core (forward and backward) for every
  backend, so a NaN / inf stays in its packed segment and never flows
  backwards in time (without `segment_ids` the row is one segment).
- B = 0 or T = 0 never reach the core (empty results, the state passes through).

The chunked algorithm both chunked backends implement is in `docs/gdn_math.md`.
"""

import dataclasses
import functools
from typing import Any, ClassVar, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member
from tokamax._src.ops import op

from tokamax_gdn.autotuning import ShippedAutotuningCacheMixin
from tokamax_gdn.ops import autodiff
from tokamax_gdn.ops import checks
from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import isolation
from tokamax_gdn.ops.gated_delta_rule import prologue

AbstractArray = jax.ShapeDtypeStruct | jax.core.ShapedArray
Output: TypeAlias = tuple[jax.Array, jax.Array | None]


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["states", "tmats", "guard"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Residuals:
  """What a forward hands its analytical backward besides the op inputs.

  states: states saved at N points of the sequence (chunk or block entries;
    which ones, and their layout, is the implementation's business), or None.
  tmats: per-chunk WY inverses, for implementations that save them, or None.
  guard: what a core running the whole NaN guard itself (`whole_guard_in_core`)
    hands its backward (the forward's per-token flags), or None.
  """

  states: Float[Array, "..."] | None = None
  tmats: Float[Array, "..."] | None = None
  guard: Float[Array, "..."] | None = None


def _check_segment_states(initial_state, segment_ids, per_state: tuple[int, ...]) -> None:
  """bind's checks of a per-segment `initial_state` [B, N, Hv, K, V]."""
  b, hv, dk, dv = per_state
  if segment_ids is None:
    raise ValueError(
        f"{checks.describe('initial_state', initial_state)}: a per-segment state"
        " [B, N, Hv, K, V] needs `segment_ids` (segment n starts from"
        " initial_state[:, n]); without them pass [B, Hv, K, V].")
  n = initial_state.shape[1]
  checks.require_shape("initial_state", initial_state, (b, n, hv, dk, dv),
                       "[B, N, Hv, K, V] per-segment states")
  if n < 1:
    raise ValueError(
        f"{checks.describe('initial_state', initial_state)}: N (states per row)"
        " must be at least 1.")


def empty_final_state(query, value, initial_state) -> jax.Array:
  """The final state when B or T is 0: the initial state passes through
  unchanged ([B, Hv, K, V]); per-segment states are zeros (no segments)."""
  b, _, hv, dv = value.shape
  if initial_state is None:
    return jnp.zeros((b, hv, query.shape[3], dv), jnp.float32)
  if initial_state.ndim == 5:
    return jnp.zeros(initial_state.shape, jnp.float32)
  return initial_state.astype(jnp.float32)


def _whole_guard(op_, initial_state) -> bool:
  """Whether `op_` (forward or VJP) runs the whole NaN guard in its core
  (`whole_guard_in_core`; per-segment states take the XLA flags' path)."""
  return op_.whole_guard_in_core and (initial_state is None or initial_state.ndim == 4)


def _without_beta_sigmoid(key):
  """An autotuning cache key without `use_beta_sigmoid`: a pointwise sigmoid
  of [B, T, Hv] changes which tiling is fastest no more than the values of
  beta do, so calls with logits and with betas share their tuned entries
  (and the entries tuned before the flag existed)."""
  return type(key)({k: v for k, v in key.items() if k != "use_beta_sigmoid"})


def _beta_sigmoid_in_core(op_, use_beta_sigmoid: bool, initial_state) -> bool:
  """Whether `op_`'s core takes beta's logits and applies the sigmoid (and
  its VJP) itself: with `prologue_in_core` on the whole-guard path (the
  XLA guard's paths get sigmoid(beta), as cores without the prologue do)."""
  return (use_beta_sigmoid and op_.prologue_in_core
          and _whole_guard(op_, initial_state))


def _core_beta(op_, beta, use_beta_sigmoid: bool, initial_state):
  """(beta as `op_`'s core takes it, whether the core takes the sigmoid):
  the logits where `_beta_sigmoid_in_core`, else sigmoid(logits) in XLA
  (or beta itself without `use_beta_sigmoid`)."""
  in_core = _beta_sigmoid_in_core(op_, use_beta_sigmoid, initial_state)
  if use_beta_sigmoid and not in_core:
    beta = prologue.beta_sigmoid(beta)
  return beta, in_core


def float32_state(initial_state: jax.Array | None) -> jax.Array | None:
  """`initial_state` as float32, the one state dtype of every Op (`bind`
  refuses others). A float state of another dtype is cast (exactly, from
  bfloat16 or float16); cast before the Op, outside its custom VJP, its
  gradient comes back in its own dtype. Anything else is left for `bind`'s
  errors."""
  if (initial_state is not None and hasattr(initial_state, "dtype")
      and jnp.issubdtype(initial_state.dtype, jnp.floating)
      and initial_state.dtype != jnp.float32):
    return initial_state.astype(jnp.float32)
  return initial_state


def _float64_to_float32(tree):
  """Every float64 array of `tree` as float32.

  All implementations compute in float32 and keep float32 states (one state
  layout for all of them, and docs/design.md's numerical contract is float32), so float64
  inputs (under jax_enable_x64) are cast on the way in, outside the op's
  custom VJP: their gradients come back as float64 through the cast, and
  `out` is cast back to float64.
  """
  def cast(x):
    if getattr(x, "dtype", None) == jnp.float64:
      return x.astype(jnp.float32)
    return x
  return jax.tree.map(cast, tree)


class GatedDeltaRule[C, K](ShippedAutotuningCacheMixin, op.Op[Any, Output, Residuals, C, K]):
  """Gated delta rule op. Subclasses implement `_core_fwd`."""

  def _get_autotuning_cache_key(self, ba: op.BoundArguments) -> Any:
    """tokamax's key without `use_beta_sigmoid` (`_without_beta_sigmoid`)."""
    return _without_beta_sigmoid(super()._get_autotuning_cache_key(ba))

  # K or V above this: NotImplementedError, so `implementation=` falls through.
  max_head_dim: ClassVar[int | None] = None
  # Chunked backends set prologue.CHUNKED_LOG_DECAY_FLOOR (see there).
  log_decay_floor: ClassVar[float | None] = None
  # Whether `_core_fwd` (and the VJP's `_core_bwd`) take an initial_state of
  # shape [B, N, Hv, K, V] (per-segment states); if not, bind raises
  # NotImplementedError for one, so `implementation=` falls through.
  supports_segment_states: ClassVar[bool] = False
  # Whether `_core_fwd` takes `poison=` ([B, T, Hv] float32: NaN at the tokens
  # whose outputs must be NaN, else 0) and makes those outputs NaN itself
  # (its inputs come sanitised): part of `isolation.SegmentGuard` inside the
  # kernel instead of a pass over the outputs in XLA. Only for cores with an
  # analytical VJP (whose `guards_in_core` then sanitises in its kernel).
  guards_in_core: ClassVar[bool] = False
  # Whether `_core_fwd` (and the VJP's `_core_bwd`) take `guard=True` and then
  # run the whole `isolation.SegmentGuard` themselves, on the raw inputs,
  # states and cotangents: the poisoned outputs, final states and gradients
  # come NaN, no flags in XLA. Not with per-segment states, which take the
  # `guards_in_core` path.
  whole_guard_in_core: ClassVar[bool] = False
  # Whether `_core_fwd` runs the prologue itself: it then gets the raw query,
  # key and g (sanitised as the guard does) and `use_qk_l2norm`, `a_log`,
  # `dt_bias` and `beta_sigmoid` (beta's logits come in: `_beta_sigmoid_in_core`)
  # as keywords, and floors the log-decay at `log_decay_floor` (the VJP's
  # `_core_bwd` then does the same and returns the raw inputs' gradients: see
  # `GatedDeltaRuleVjp.prologue_in_core`).
  prologue_in_core: ClassVar[bool] = False
  # Whether `_core_fwd` takes `final_state=False` (the call's
  # `output_final_state=False`, on the analytical-VJP paths) and then returns
  # None for it, not computing it: a state-sized output that the kernel's
  # last chunk writes back is an HBM write nothing hides.
  final_state_optional: ClassVar[bool] = False

  def __call__(self, *args, **kwargs):
    """The op; float64 inputs run in float32 (see `_float64_to_float32`)."""
    with autodiff.reverse_mode_only("gated_delta_rule", args, kwargs):
      value = args[2] if len(args) > 2 else kwargs.get("value")
      args, kwargs = _float64_to_float32((args, kwargs))
      result = super().__call__(*args, **kwargs)
      if getattr(value, "dtype", None) == jnp.float64:
        (out, final_state), *residuals = result if kwargs.get("return_residuals") else (result,)
        out = (out.astype(jnp.float64), final_state)
        result = (out, *residuals) if residuals else out
      return result

  def bind(
      self,
      query: Float[Array | AbstractArray, "B T Hk K"],
      key: Float[Array | AbstractArray, "B T Hk K"],
      value: Float[Array | AbstractArray, "B T Hv V"],
      g: Float[Array | AbstractArray, "B T Hv"],
      beta: Float[Array | AbstractArray, "B T Hv"],
      *,
      scale: float | None = None,
      initial_state: Float[Array | AbstractArray, "B Hv K V"]
      | Float[Array | AbstractArray, "B N Hv K V"] | None = None,
      output_final_state: bool = False,
      use_qk_l2norm: bool = False,
      use_beta_sigmoid: bool = False,
      a_log: Float[Array | AbstractArray, "Hv"] | None = None,
      dt_bias: Float[Array | AbstractArray, "Hv"] | None = None,
      segment_ids: Int[Array | AbstractArray, "B T"] | None = None,
      return_residuals: bool = False,
  ) -> op.BoundArguments:
    """Checks shapes and dtypes once for every backend; fills in `scale`."""
    for name, x in (("query", query), ("key", key), ("value", value)):
      checks.require_rank(name, x, 4, "[batch, time, heads, head_dim]")
      checks.require_float(name, x)
    # One dtype: it is the kernels' matmul input dtype and `out`'s.
    checks.require_same_dtype(query=query, key=key, value=value)
    b, t, hk, dk = query.shape
    checks.require_shape("key", key, (b, t, hk, dk), "same as `query` [B, T, Hk, K]")
    if value.shape[:2] != (b, t):
      raise ValueError(
          f"{checks.describe('value', value)}: batch and time must match `query`"
          f" {(b, t)}."
      )
    hv, dv = value.shape[2], value.shape[3]
    if hk == 0 or hv % hk:
      raise ValueError(
          f"{checks.describe('value', value)}: value heads Hv={hv} must be a multiple"
          f" of key heads Hk={hk} (from `query`/`key`)."
      )
    for name, x in (("g", g), ("beta", beta)):
      checks.require_rank(name, x, 3, "[batch, time, value_heads]")
      checks.require_float(name, x)
      checks.require_shape(name, x, (b, t, hv), "[B, T, Hv]")
    if initial_state is not None:
      checks.require_float("initial_state", initial_state)
      checks.require_float32("initial_state", initial_state,
                             "states are float32; `gated_delta_rule` casts other float dtypes")
      if initial_state.ndim == 5:
        _check_segment_states(initial_state, segment_ids, (b, hv, dk, dv))
        if not self.supports_segment_states:
          raise NotImplementedError(
              f"{type(self).__name__} does not support per-segment states"
              " (`initial_state` of shape [B, N, Hv, K, V]).")
      else:
        checks.require_shape("initial_state", initial_state, (b, hv, dk, dv),
                             "[B, Hv, K, V], or [B, N, Hv, K, V] with `segment_ids`")
    if (a_log is None) != (dt_bias is None) and a_log is None:
      raise ValueError("`dt_bias` was given without `a_log`; pass both or neither.")
    for name, x in (("a_log", a_log), ("dt_bias", dt_bias)):
      if x is not None:
        checks.require_float(name, x)
        checks.require_shape(name, x, (hv,), "[Hv]")
    if segment_ids is not None:
      if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise TypeError(f"{checks.describe('segment_ids', segment_ids)} must be integer.")
      checks.require_shape("segment_ids", segment_ids, (b, t), "[B, T]")
    if scale is None:
      scale = dk**-0.5
    if self.max_head_dim is not None and max(dk, dv) > self.max_head_dim:
      raise NotImplementedError(
          f"{type(self).__name__} supports head dims up to {self.max_head_dim};"
          f" got K={dk}, V={dv}."
      )
    return super().bind(
        query, key, value, g, beta,
        scale=float(scale),
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        use_qk_l2norm=bool(use_qk_l2norm),
        use_beta_sigmoid=bool(use_beta_sigmoid),
        a_log=a_log,
        dt_bias=dt_bias,
        segment_ids=segment_ids,
        return_residuals=return_residuals,
    )

  def _fwd(
      self,
      query: Float[Array, "B T Hk K"],
      key: Float[Array, "B T Hk K"],
      value: Float[Array, "B T Hv V"],
      g: Float[Array, "B T Hv"],
      beta: Float[Array, "B T Hv"],
      *,
      scale: float,
      initial_state: Float[Array, "B Hv K V"] | None,
      output_final_state: bool,
      use_qk_l2norm: bool,
      use_beta_sigmoid: bool = False,   # (default: entries tuned before the flag still bind)
      a_log: Float[Array, "Hv"] | None,
      dt_bias: Float[Array, "Hv"] | None,
      segment_ids: Int[Array, "B T"] | None,
      return_residuals: bool,
      config: C,
  ) -> tuple[Output, Residuals]:
    core = functools.partial(self._core_fwd, scale=scale, segment_ids=segment_ids,
                             config=config)
    beta, sigmoid_in_core = _core_beta(self, beta, use_beta_sigmoid, initial_state)
    if self.prologue_in_core:
      q, k, log_decay = query, key, g
      core = functools.partial(core, use_qk_l2norm=use_qk_l2norm, a_log=a_log,
                               dt_bias=dt_bias, beta_sigmoid=sigmoid_in_core)
    else:
      q, k, log_decay = prologue.prologue(
          query, key, g, a_log, dt_bias, use_qk_l2norm=use_qk_l2norm,
          log_decay_floor=self.log_decay_floor,
      )
    if self.final_state_optional and self.vjp is not None:
      core_vjp = functools.partial(core, final_state=output_final_state)
    else:
      core_vjp = core
    if query.shape[0] == 0 or query.shape[1] == 0:
      out = jnp.zeros(value.shape, value.dtype)
      final_state = empty_final_state(query, value, initial_state)
      residuals = None
    elif _whole_guard(self, initial_state):
      out, final_state, residuals = core_vjp(q, k, value, log_decay, beta,
                                             initial_state=initial_state, guard=True)
    else:
      # An analytical VJP guards its own backward, so this forward leaves the
      # queries unchecked (see `SegmentGuard.bad_q`).
      guard = isolation.guard_segments(query, key, value, beta, initial_state, segment_ids,
                                       g=g, a_log=a_log, dt_bias=dt_bias,
                                       check_query=self.vjp is None)
      if self.vjp is None:       # differentiated by autodiff through this
        residuals = None
        out, final_state = isolation.guarded_autodiff(core, guard, q, k, value, log_decay,
                                                      beta, initial_state)
      else:                      # `GatedDeltaRuleVjp` guards the backward
        *clean, clean_state = guard.sanitize(q, k, value, log_decay, beta, initial_state)
        if self.guards_in_core:  # the core makes the poisoned outputs NaN itself
          out, final_state, residuals = core_vjp(*clean, initial_state=clean_state,
                                                 poison=guard.output_poison())
          final_state = guard.poison_final_state(final_state)
        else:
          out, final_state, residuals = core_vjp(*clean, initial_state=clean_state)
          out, final_state = guard.poison_outputs(out, final_state)
    out = out.astype(value.dtype)
    final_state = final_state if output_final_state else None
    return (out, final_state), (residuals if return_residuals else None)

  def _core_fwd(
      self,
      q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"], v: Float[Array, "B T Hv V"],
      log_decay: Float[Array, "B T Hv"], beta: Float[Array, "B T Hv"],
      *,
      scale: float,
      initial_state: segments.State | None,
      segment_ids: Int[Array, "B T"] | None,
      config: C,
  ) -> tuple[Float[Array, "B T Hv V"], segments.State, Residuals | None]:
    """Returns (out [B,T,Hv,V], final_state f32, residuals).

    final_state is [B, Hv, K, V], or [B, N, Hv, K, V] for per-segment states
    (`initial_state` [B, N, Hv, K, V], only if `supports_segment_states`).
    T and B are at least 1 here.
    """
    raise NotImplementedError


class GatedDeltaRuleVjp[C, K](ShippedAutotuningCacheMixin, op.Op[Any, dict[str, jax.Array], None, C, K]):
  """Analytical VJP plumbing: prologue by autodiff, `_core_bwd` by hand."""

  # Must equal the forward Op's `log_decay_floor`.
  log_decay_floor: ClassVar[float | None] = None
  # Whether `_core_bwd` takes `sanitize=True` and then zeroes non-finite q, k,
  # v and d_out itself (log_decay, beta and the states come sanitised).
  guards_in_core: ClassVar[bool] = False
  # Whether `_core_bwd` takes `guard=True` (see `GatedDeltaRule.whole_guard_in_core`).
  whole_guard_in_core: ClassVar[bool] = False
  # Whether `_core_bwd` runs the prologue and its VJP itself (with the
  # forward's `prologue_in_core`): it gets the raw query, key and g and the
  # prologue's keywords, and returns the gradients of the raw query, key and
  # g, then with `a_log` two more, [B, 1, Hv] float32 each: each batch
  # row's parts of a_log's and dt_bias's gradients.
  prologue_in_core: ClassVar[bool] = False

  def _get_autotuning_cache_key(self, ba: op.BoundArguments) -> Any:
    """tokamax's key with `residuals` as None.

    The residuals' shapes follow the forward's config (how many states it
    saved), which autotuning the forward changes; the fastest backward tiling
    depends on the shapes of the inputs. Without this, tuning the forward
    would orphan every tuned VJP entry. A backward whose config doesn't fit the
    saved residuals recomputes what it needs.
    """
    key = _without_beta_sigmoid(super()._get_autotuning_cache_key(ba))
    return type(key)({**key, "residuals": None})

  def _fwd(
      self,
      residuals: Residuals | None,
      out: Output,
      dout: Output,
      query: Float[Array, "B T Hk K"],
      key: Float[Array, "B T Hk K"],
      value: Float[Array, "B T Hv V"],
      g: Float[Array, "B T Hv"],
      beta: Float[Array, "B T Hv"],
      *,
      scale: float,
      initial_state: Float[Array, "B Hv K V"] | None,
      output_final_state: bool,
      use_qk_l2norm: bool,
      use_beta_sigmoid: bool = False,   # (default: entries tuned before the flag still bind)
      a_log: Float[Array, "Hv"] | None,
      dt_bias: Float[Array, "Hv"] | None,
      segment_ids: Int[Array, "B T"] | None,
      return_residuals: bool,
      config: C,
  ) -> tuple[dict[str, jax.Array], None]:
    del out, return_residuals
    beta_logits = beta
    beta, sigmoid_in_core = _core_beta(self, beta, use_beta_sigmoid, initial_state)
    if self.prologue_in_core:
      q, k, log_decay = query, key, g
    else:
      pro = functools.partial(prologue.prologue, use_qk_l2norm=use_qk_l2norm,
                              log_decay_floor=self.log_decay_floor)
      (q, k, log_decay), pro_vjp = jax.vjp(pro, query, key, g, a_log, dt_bias)
    da_log = None if a_log is None else jnp.zeros(a_log.shape, jnp.float32)
    ddt_bias = None if dt_bias is None else jnp.zeros(dt_bias.shape, jnp.float32)
    d_out, d_final = dout
    if not output_final_state or d_final is None:
      d_final = None
    if query.shape[0] == 0 or query.shape[1] == 0:
      dq, dk, dv, d_log_decay, dbeta = map(jnp.zeros_like, (q, k, value, log_decay, beta))
      d_initial = None
      if initial_state is not None:
        # T = 0: a [B, Hv, K, V] state passes through; per-segment states
        # reach no output (there are no segments).
        d_initial = (d_final if d_final is not None and initial_state.ndim == 4
                     else jnp.zeros_like(initial_state, jnp.float32))
    else:
      core_bwd = functools.partial(self._core_bwd, residuals, scale=scale,
                                   segment_ids=segment_ids, config=config)
      if self.prologue_in_core:
        core_bwd = functools.partial(core_bwd, use_qk_l2norm=use_qk_l2norm, a_log=a_log,
                                     dt_bias=dt_bias, beta_sigmoid=sigmoid_in_core)
      if _whole_guard(self, initial_state):
        grads = core_bwd(q, k, value, log_decay, beta, d_out, d_final,
                         initial_state=initial_state, guard=True)
        if self.prologue_in_core and a_log is not None:
          da_log, ddt_bias = (jnp.sum(x, (0, 1)) for x in grads[6:8])
        dq, dk, dv, d_log_decay, dbeta, d_initial = grads[:6]
      else:
        guard = isolation.guard_segments(query, key, value, beta, initial_state, segment_ids,
                                         g=g, a_log=a_log, dt_bias=dt_bias)
        poison = guard.gradient_poison(d_out, d_final)
        if self.guards_in_core:    # the core zeroes non-finite q, k, v, d_out itself
          ld, bt, clean_state = guard.sanitize_small(log_decay, beta, initial_state)
          grads = core_bwd(q, k, value, ld, bt, d_out, isolation.zero_nonfinite(d_final),
                           initial_state=clean_state, sanitize=True)
        else:
          *clean, clean_state = guard.sanitize(q, k, value, log_decay, beta, initial_state)
          grads = core_bwd(*clean, isolation.zero_nonfinite(d_out),
                           isolation.zero_nonfinite(d_final),
                           initial_state=clean_state)
        if self.prologue_in_core and a_log is not None:
          da_log, ddt_bias = (guard.poison_head_sums(poison, jnp.sum(x, (0, 1)))
                              for x in grads[6:8])
        dq, dk, dv, d_log_decay, dbeta, d_initial = guard.poison_gradients(poison, *grads[:6])
    if self.prologue_in_core:   # the core's gradients are the raw inputs'
      dquery, dkey, dg = dq.astype(query.dtype), dk.astype(key.dtype), d_log_decay
    else:
      dquery, dkey, dg, da_log, ddt_bias = pro_vjp(
          (dq.astype(q.dtype), dk.astype(k.dtype), d_log_decay.astype(jnp.float32))
      )
    if use_beta_sigmoid and not sigmoid_in_core:   # sigmoid's VJP
      dbeta = dbeta.astype(jnp.float32) * (beta * (1.0 - beta))
    grads = dict(
        query=dquery,
        key=dkey,
        value=dv.astype(value.dtype),
        g=dg.astype(g.dtype),
        beta=dbeta.astype(beta_logits.dtype),
    )
    if initial_state is not None:
      grads["initial_state"] = d_initial.astype(initial_state.dtype)
    if a_log is not None:
      grads["a_log"] = da_log.astype(a_log.dtype)
      if dt_bias is not None:
        grads["dt_bias"] = ddt_bias.astype(dt_bias.dtype)
    return grads, None

  def _core_bwd(
      self,
      residuals: Residuals | None,
      q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"], v: Float[Array, "B T Hv V"],
      log_decay: Float[Array, "B T Hv"], beta: Float[Array, "B T Hv"],
      d_out: Float[Array, "B T Hv V"],
      d_final: segments.State | None,
      *,
      scale: float,
      initial_state: segments.State | None,
      segment_ids: Int[Array, "B T"] | None,
      config: C,
  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Returns (dq, dk, dv, d_log_decay, dbeta, d_initial_state f32).

    d_initial_state has initial_state's shape ([B, Hv, K, V] or, for
    per-segment states, [B, N, Hv, K, V]); None without an initial state.
    """
    raise NotImplementedError

