"""`causal_conv1d_gated_delta_rule`: the user-facing function."""

from collections.abc import Sequence

import jax

from tokamax_gdn import registry


def causal_conv1d_gated_delta_rule(
    qkv: jax.Array,
    b: jax.Array,
    a: jax.Array,
    conv_state: jax.Array,
    recurrent_state: jax.Array,
    conv_weight: jax.Array,
    conv_bias: jax.Array | None,
    a_log: jax.Array,
    dt_bias: jax.Array,
    query_start_loc: jax.Array,
    state_indices: jax.Array,
    distribution: jax.Array,
    seq_lens: jax.Array,
    read_state_indices: jax.Array | None = None,
    read_offsets: jax.Array | None = None,
    *,
    n_kq: int,
    n_v: int,
    d_k: int,
    d_v: int,
    kernel_size: int,
    num_spec_tokens: int = 0,
    implementation: str | Sequence[str] | None = None,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
  """Serving GDN layer core on state pools, as tokamax 0.0.17's op of this name.

  A ragged batch of requests (decodes, speculative verify windows, prefills,
  continuations) in one call; their conv and recurrent states live in pools of
  slots updated in place. Semantics: `base.py` of this folder (module doc).

  Dtypes: the float inputs may each have their own (`qkv` sets `out`'s; each
  pool is bfloat16 or float32 and keeps its dtype); every implementation
  computes in float32. The q, k and v of a token come in one `qkv` row, so
  they share a dtype, as `gated_delta_rule` requires of its own.

  Args:
    qkv: [T, 2 n_kq d_k + n_v d_v] raw (pre-conv) q, k, v of T packed tokens.
    b, a: [T, n_v] raw beta / gate inputs.
    conv_state: [S, kernel_size - 1, dim] pool (bf16 or f32): the last inputs.
    recurrent_state: [S, n_v, d_k, d_v] pool (bf16 or f32).
    conv_weight: [dim, 1, kernel_size]; conv_bias: [dim] or None.
    a_log, dt_bias: [n_v] gate parameters.
    query_start_loc: [R + 1] int: request r owns tokens [qsl[r], qsl[r+1]).
    state_indices: [R] int: request r's slot (first of num_spec_tokens + 1
      consecutive checkpoint slots for decode requests).
    distribution: [3] int [decode_end, prefill_end, mixed_end]: requests below
      decode_end decode (1 token, or a verify window of up to
      num_spec_tokens + 1); requests from mixed_end on are padding.
    seq_lens: [R] int: a request continues its read slot's states when
      seq_lens[r] exceeds its token count, else starts from zeros.
    read_state_indices: [R] int or None (= state_indices): slot to read from.
    read_offsets: [R] int or None (zeros): checkpoint offset added to the read
      slot (required with num_spec_tokens > 0).
    n_kq, n_v, d_k, d_v, kernel_size: static sizes (n_v a multiple of n_kq).
    num_spec_tokens: speculative draft tokens per decode request.
    implementation: None (best for the backend), a name from
      `tokamax_gdn.registry.implementations("causal_conv1d_gated_delta_rule")`,
      a `tokamax.Op`, or a sequence of those tried in order.

  Returns:
    ((new_conv_state, new_recurrent_state) in the pools' dtypes,
     out [T, n_v d_v] in qkv's dtype; zero for tokens of no valid request).
    Donate the pools under `jax.jit` to update them without a copy.
  """
  return registry.call(
      "causal_conv1d_gated_delta_rule", implementation,
      qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
      query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
      read_offsets, n_kq=n_kq, n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
      num_spec_tokens=num_spec_tokens)
