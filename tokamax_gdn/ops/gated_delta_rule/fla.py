"""`chunk_gated_delta_rule`: flash-linear-attention's (FLA) entry point, in JAX.

The way in for code ported from FLA / PyTorch (`fla.ops.gated_delta_rule.
chunk_gated_delta_rule`): the same argument names, layouts and defaults, on
top of `gated_delta_rule` with per-segment states. Variable-length batches
come as FLA's `cu_seqlens` (B = 1, sequences packed along T, one state per
sequence) and become `segment_ids` plus [1, N, Hv, K, V] states here.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.ops import checks
from tokamax_gdn.ops.gated_delta_rule import api


def chunk_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens: jax.Array | Sequence[int] | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    implementation: str | Sequence[str] | None = None,
) -> tuple[jax.Array, jax.Array | None]:
  """Gated delta rule with FLA's interface (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`).

  S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = scale S_t^T q_t,
  per value head h, reading key head h // (Hv // H) (FLA's GVA convention).

  Args:
    q, k: [B, T, H, K] queries and keys.
    v: [B, T, Hv, V] values; Hv a multiple of H.
    g: [B, T, Hv] forget gate in log space (log-decay, <= 0), as FLA's `g`.
    beta: [B, T, Hv] write strengths.
    scale: default K ** -0.5, as FLA.
    initial_state: [N, Hv, K, V] float state per input sequence: N = B
      without `cu_seqlens`, else N = len(cu_seqlens) - 1.
    output_final_state: also return the final state [N, Hv, K, V] (float32).
    cu_seqlens: [N + 1] int cumulative sequence lengths (0 first, T last,
      non-decreasing), FlashAttention-style: sequence i is tokens
      cu_seqlens[i]:cu_seqlens[i+1] of the one row (B must be 1). N is static;
      the values may be traced (then they are not checked). An empty sequence
      returns its initial state (or zeros) as its final state, as FLA does.
    use_qk_l2norm_in_kernel: L2-normalise q and k first (x / sqrt(sum x^2 +
      1e-6), forward and backward).
    implementation: as `tokamax_gdn.gated_delta_rule` (not in FLA). With
      `cu_seqlens` it needs per-segment states; implementations without them
      raise NotImplementedError and `None` falls through to one that has them.

  Returns:
    (o [B, T, Hv, V] in q's dtype (FLA's), final_state [N, Hv, K, V] float32
    or None). Gradients flow to q, k, v, g, beta and initial_state.
  """
  if cu_seqlens is None or (initial_state is None and not output_final_state):
    # No per-sequence state to carry: plain segments (every implementation).
    segment_ids = None if cu_seqlens is None else _segment_ids(q, cu_seqlens)[0]
    out, final = api.gated_delta_rule(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
        output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm_in_kernel,
        implementation=implementation)
    return out.astype(q.dtype), final

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
      segment_ids=segment_ids, implementation=implementation)
  if final is not None:
    final = jnp.where(nonempty[:, None, None, None],
                      final[0, jnp.clip(run_of_seq, 0, n - 1)], states)
  return out.astype(q.dtype), final


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
