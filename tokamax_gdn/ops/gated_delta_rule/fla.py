"""`chunk_gated_delta_rule`: flash-linear-attention's (FLA) entry point, in JAX.

The way in for code ported from FLA / PyTorch (`fla.ops.gated_delta_rule.
chunk_gated_delta_rule`): the same argument names, layouts and defaults, on
top of `gated_delta_rule` with per-segment states. Variable-length batches
come as FLA's `cu_seqlens` (B = 1, sequences packed along T, one state per
sequence) and become `segment_ids` plus [1, N, Hv, K, V] states here.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.ops import checks
from tokamax_gdn.ops.gated_delta_rule import api


# FLA's keyword-only extras (its **kwargs) that are accepted here.
_FLA_KWARGS = ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size", "transpose_state_layout")
# FLA's gated delta rule chunk sizes (it refuses others).
FLA_CHUNK_SIZES = (16, 32, 64)


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: jax.Array | Sequence[int] | None = None,
    cu_seqlens_cpu: jax.Array | Sequence[int] | None = None,
    chunk_indices: Any = None,
    cp_context: Any = None,
    *,
    implementation: str | Sequence[str] | None = None,
    **kwargs,
) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule with FLA's interface (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`).

  S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = scale S_t^T q_t,
  per value head h, reading key head h // (Hv // H) (FLA's GVA convention).

  The positional order is FLA's (0.6), so ported calls that pass
  `use_qk_l2norm_in_kernel` or `cu_seqlens` by position mean the same here.

  Dtypes as FLA's: q, k and v may differ (float dtypes): the op then runs on
  their common dtype (`jnp.promote_types`; `gated_delta_rule` itself takes one)
  and `o` comes back in q's. g and beta may have any float dtype. Computation
  and states are float32: an `initial_state` of another float dtype is cast to
  float32 (as FLA's kernels read it), its gradient coming back in its dtype.

  Args:
    q, k: [B, T, H, K] queries and keys.
    v: [B, T, Hv, V] values; Hv a multiple of H.
    g: [B, T, Hv] forget gate in log space (log-decay, <= 0), as FLA's `g`;
      with `use_gate_in_kernel`, the raw gate (see there).
    beta: [B, T, Hv] write strengths (logits with `use_beta_sigmoid_in_kernel`).
    scale: default K ** -0.5, as FLA.
    initial_state: [N, Hv, K, V] state per input sequence, any float dtype
      ([N, Hv, V, K] with `state_v_first`): N = B without `cu_seqlens`, else
      N = len(cu_seqlens) - 1.
    output_final_state: also return the final state [N, Hv, K, V] (float32;
      [N, Hv, V, K] with `state_v_first`).
    use_qk_l2norm_in_kernel: L2-normalise q and k first (x / sqrt(sum x^2 +
      1e-6), forward and backward).
    use_beta_sigmoid_in_kernel: `beta` holds logits; the op uses
      sigmoid(beta) (gradients flow to the logits).
    allow_neg_eigval: with `use_beta_sigmoid_in_kernel` (FLA requires it),
      beta = 2 sigmoid(logits) in (0, 2): the transition I - beta k k^T may
      have a negative eigenvalue (down to -1 with unit keys, e.g. with
      `use_qk_l2norm_in_kernel`), so the state stays bounded and every
      implementation computes it within the usual contract.
    state_v_first: states in FLA's V-first layout [N, Hv, V, K] (the
      transpose of ours), in and out.
    cu_seqlens: [N + 1] int cumulative sequence lengths (0 first, T last,
      non-decreasing), FlashAttention-style: sequence i is tokens
      cu_seqlens[i]:cu_seqlens[i+1] of the one row (B must be 1). N is static;
      the values may be traced (then they are not checked). An empty sequence
      returns its initial state (or zeros) as its final state, as FLA does.
    cu_seqlens_cpu, chunk_indices: FLA's precomputed host copies of
      `cu_seqlens` and chunk indices; accepted for its positional order and
      not needed here (everything is derived from `cu_seqlens`).
    cp_context: FLA's torch.distributed context parallelism; not supported
      (NotImplementedError): call `tokamax_gdn.gated_delta_rule(...,
      context_parallel_axis=...)` inside `jax.shard_map` instead.
    implementation: keyword only, as `tokamax_gdn.gated_delta_rule` (not in
      FLA). With `cu_seqlens` it needs per-segment states; implementations
      without them raise NotImplementedError and `None` falls through to one
      that has them.
    **kwargs: FLA's keyword-only extras: `use_gate_in_kernel=True` with
      `A_log` [Hv] (and optionally `dt_bias` [Hv]): `g` is the raw gate and
      the log-decay is -exp(A_log) softplus(g + dt_bias), computed inside with
      gradients for all three (our `a_log` / `dt_bias`); `chunk_size` in
      (16, 32, 64) as FLA allows (a tiling choice: each implementation keeps
      its own tuned chunk, the results are the same within the contract);
      `transpose_state_layout`, FLA's deprecated name of `state_v_first`. Any
      other keyword is a TypeError naming it.

  Returns:
    (o [B, T, Hv, V] in q's dtype (FLA's), final_state [N, Hv, K, V] float32
    or None). Gradients flow to q, k, v, g, beta and initial_state.
  """
  unknown = sorted(set(kwargs) - set(_FLA_KWARGS))
  if unknown:
    raise TypeError(f"chunk_gated_delta_rule() got unexpected keyword argument(s) {unknown};"
                    f" FLA's keyword-only extras accepted here: {list(_FLA_KWARGS)}.")
  if cp_context is not None:
    raise NotImplementedError(
        "`cp_context` (FLA's torch.distributed context parallelism) is not supported: call"
        " tokamax_gdn.gated_delta_rule(..., context_parallel_axis=AXIS) inside jax.shard_map"
        " with T sharded over AXIS.")
  del cu_seqlens_cpu, chunk_indices
  if "transpose_state_layout" in kwargs:
    if state_v_first:
      raise ValueError("Pass `state_v_first` or the deprecated `transpose_state_layout`,"
                       " not both.")
    state_v_first = bool(kwargs["transpose_state_layout"])
  chunk_size = kwargs.get("chunk_size", 64)
  if chunk_size not in FLA_CHUNK_SIZES:
    raise ValueError(f"`chunk_size`={chunk_size!r}: FLA's gated delta rule allows"
                     f" {FLA_CHUNK_SIZES}.")
  a_log, dt_bias = kwargs.get("A_log"), kwargs.get("dt_bias")
  if kwargs.get("use_gate_in_kernel", False):
    if a_log is None:
      raise ValueError("`use_gate_in_kernel=True` needs `A_log` (as in FLA).")
  elif a_log is not None or dt_bias is not None:
    raise ValueError("`A_log` / `dt_bias` are used only with `use_gate_in_kernel=True`"
                     " (FLA ignores them otherwise); pass that too, or drop them.")
  if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
    raise ValueError("`allow_neg_eigval=True` requires `use_beta_sigmoid_in_kernel=True`"
                     " (as in FLA).")
  # The op takes the logits itself (`use_beta_sigmoid`), except for
  # allow_neg_eigval's 2 sigmoid, taken here.
  use_beta_sigmoid = use_beta_sigmoid_in_kernel and not allow_neg_eigval
  if allow_neg_eigval:
    beta = 2 * jax.nn.sigmoid(beta.astype(jnp.float32)).astype(beta.dtype)
  if state_v_first and initial_state is not None:
    initial_state = jnp.swapaxes(initial_state, -1, -2)
  out_dtype = getattr(q, "dtype", None)
  q, k, v = _common_float_dtype(q, k, v)
  out, final = _chunk_gated_delta_rule(
      q, k, v, g, beta, scale=scale, initial_state=initial_state,
      output_final_state=output_final_state, cu_seqlens=cu_seqlens,
      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, use_beta_sigmoid=use_beta_sigmoid,
      a_log=a_log, dt_bias=dt_bias, implementation=implementation)
  if state_v_first and final is not None:
    final = jnp.swapaxes(final, -1, -2)
  return out.astype(out_dtype), final


def _common_float_dtype(*xs):
  """xs in their promoted dtype when all are float arrays (else as they are,
  for `gated_delta_rule`'s errors to name them)."""
  if not all(hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) for x in xs):
    return xs
  dtype = jnp.result_type(*(x.dtype for x in xs))
  return tuple(x.astype(dtype) for x in xs)


def _chunk_gated_delta_rule(q, k, v, g, beta, *, scale, initial_state, output_final_state,
                            cu_seqlens, use_qk_l2norm_in_kernel, use_beta_sigmoid, a_log,
                            dt_bias, implementation):
  """`chunk_gated_delta_rule` in our layouts (states [N, Hv, K, V])."""
  if cu_seqlens is None or (initial_state is None and not output_final_state):
    # No per-sequence state to carry: plain segments (every implementation).
    segment_ids = None if cu_seqlens is None else _segment_ids(q, cu_seqlens)[0]
    out, final = api.gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
        use_beta_sigmoid=use_beta_sigmoid, a_log=a_log, dt_bias=dt_bias,
        implementation=implementation)
    return out, final

  segment_ids, cu = _segment_ids(q, cu_seqlens)
  n = cu.shape[0] - 1
  hv, dk, dv = v.shape[2], q.shape[3], v.shape[3]
  if initial_state is not None:
    checks.require_shape("initial_state", initial_state, (n, hv, dk, dv),
                         f"[N, Hv, K, V], N = len(cu_seqlens) - 1 = {n}")

  # Sequence i is segment i. Empty sequences make no run of ids, so the op's
  # segment (run) r is the r-th non-empty sequence.
  nonempty = cu[1:] > cu[:-1]                                            # [N]
  run_of_seq = jnp.cumsum(nonempty, dtype=jnp.int32) - 1                 # [N]
  seq_of_run = jnp.searchsorted(run_of_seq, jnp.arange(n), side="left")  # [N]
  has_run = jnp.arange(n) <= run_of_seq[-1]
  states = (jnp.zeros((n, hv, dk, dv), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
  run_states = jnp.where(has_run[:, None, None, None],
                         states[jnp.minimum(seq_of_run, n - 1)], 0.0)
  out, final = api.gated_delta_rule(
      q, k, v, g, beta, scale=scale, initial_state=run_states[None],
      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
      use_beta_sigmoid=use_beta_sigmoid, a_log=a_log, dt_bias=dt_bias,
      segment_ids=segment_ids, implementation=implementation)
  if final is not None:
    final = jnp.where(nonempty[:, None, None, None],
                      final[0, jnp.clip(run_of_seq, 0, n - 1)], states)
  return out, final


def _segment_ids(q: jax.Array, cu_seqlens) -> tuple[jax.Array, jax.Array]:
  """([1, T] int32 sequence index of each token, cu_seqlens as an array), checked."""
  checks.require_rank("q", q, 4, "[B, T, H, K]")
  bsz, t = q.shape[:2]
  if bsz != 1:
    raise ValueError(f"{checks.describe('q', q)}: with `cu_seqlens` the batch size must be 1"
                     " (sequences packed along T), as in FLA.")
  cu = jnp.asarray(cu_seqlens)
  if cu.ndim != 1 or cu.shape[0] < 2 or not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"{checks.describe('cu_seqlens', cu)}: expected [N + 1] integers, N >= 1.")
  if not isinstance(cu, jax.core.Tracer):
    c = np.asarray(cu)
    if c[0] != 0 or c[-1] != t or np.any(np.diff(c) < 0):
      raise ValueError(f"`cu_seqlens`={c.tolist()}: must start at 0, end at T={t} and"
                       " not decrease.")
  # Token t belongs to sequence i when cu[i] <= t < cu[i+1].
  segment_ids = jnp.searchsorted(cu[1:-1], jnp.arange(t), side="right").astype(jnp.int32)
  return segment_ids[None], cu
