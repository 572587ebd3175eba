"""MaxText drop-in: `jax_chunk_gated_delta_rule` on tokamax_gdn's kernels.

MaxText (0.2.5, `maxtext/models/qwen3.py`) computes the Qwen3-Next / Qwen3.5
GatedDeltaNet core with

  jax_chunk_gated_delta_rule(query, key, value, g, beta, chunk_size=64,
      initial_state=None, use_qk_norm_in_gdn=False, cp_axis=None,
      compute_dtype=jnp.bfloat16) -> (out, final_state)

a pure-JAX chunked WY scan differentiated by autodiff. This module's function
has the same signature and meaning and runs our `gated_delta_rule` op (the
Pallas TPU kernels, the chunked XLA version, or the reference) with its
analytical backward, so a MaxText model switches by import (docs/integrations.md).

The semantics, as MaxText's function has them (each one checked by
tests/integrations/maxtext_test.py against an oracle written from its
definition):
  - query, key: [B, T, H, K]; value: [B, T, Hv, V]; g, beta: [B, T, Hv].
    MaxText repeats q/k to the value heads first (`jnp.repeat`, so value
    head h reads key head h // (Hv // Hk)); here H may also be Hk, the
    unrepeated heads: the same result without the repeat's copies, our
    kernels read key head h // (Hv // Hk) themselves.
  - `g` is the log-decay (<= 0), `beta` already in (0, 1) (sigmoided).
  - `use_qk_norm_in_gdn`: q and k L2-normalised first, x * rsqrt(sum x^2 +
    1e-6) (our `use_qk_l2norm`, fused into the kernels).
  - q, k, v and beta are cast to `compute_dtype`, g to float32; the scale is
    K**-0.5 rounded to `compute_dtype` (as MaxText multiplies q by it in that
    dtype); accumulation and the state are float32.
  - `initial_state` [B, Hv, K, V] (any float dtype, read as float32). The
    final state is returned ONLY when an initial state is given, [B, Hv, K,
    V] in `compute_dtype`; otherwise None.
  - out: [B, T, Hv, V] in query's dtype (as given, before any cast).
  - `cp_axis`: a mesh axis name (or a tuple of names, as MaxText's
    `gdn_context_axes` gives) with T sharded over it inside `jax.shard_map`:
    our context-parallel path (`ops/gated_delta_rule/context_parallel.py`);
    the final state is the whole sequence's, on every device of the axis.
  - `chunk_size`: MaxText's scan's WY block. Results do not depend on it (up
    to rounding), and our kernels pick their own chunk per implementation and
    shape (heuristics or autotuning; Pallas 64/128/256, XLA 16..128): here it
    is validated (a positive int, as MaxText needs) and otherwise not used.
    Pin a chunk by passing a configured Op as `implementation`.

Extras, keyword-only: `implementation` (a name, an Op, a sequence tried in
order, or None for the backend's default order) and `named_residuals`.

Remat. MaxText's GDN remat toggles (`gdn`, `gdn_conv` in {remat, device,
offload}, PR #5098) expand to checkpoint names; with `named_residuals=True`
(the default) the op's forward emits its residuals under the same names, so
MaxText's `save_only_these_names` / `save_and_offload_only_these_names`
policies keep, offload or recompute ours (`MAXTEXT_NAMES`):

  gdn_core_attn_out  the op's output (the layer's backward reads it)
  gdn_chunk_states   the chunk-entry states (Pallas: per chunk; XLA: per block)
  gdn_t_inv          each chunk's WY inverse (Pallas kernels save them; the
                     XLA version does not, recomputing them is cheap there)
  gdn_qkv            the op's query, key, value inputs
  gdn_b              beta (MaxText's sigmoid(b))
  gdn_a              g (the log-decay MaxText computes from its `a`)
  gdn_conv_out,      no counterpart here: they are the causal conv's output
  gdn_fwd_conv       and its forward residual, outside this function (the
                     MaxText layer names its conv itself)

Under a policy that saves none of them (MaxText's `full`), the backward
reruns the forward for them; with no `jax.checkpoint` around the call at all
they are kept (more memory, no second forward), as the Pallas
`save_states=True` config. Not with `cp_axis` (context parallelism keeps only
its arguments, see `context_parallel.py`): there the names select nothing.
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule import api
from tokamax_gdn.ops.gated_delta_rule import remat

# MaxText's names (its `_expand_gdn_remat_names`, PR #5098).
GDN_CORE_ATTN_OUT = "gdn_core_attn_out"
GDN_CHUNK_STATES = "gdn_chunk_states"
GDN_T_INV = "gdn_t_inv"
GDN_QKV = "gdn_qkv"
GDN_B = "gdn_b"
GDN_A = "gdn_a"
GDN_CONV_OUT = "gdn_conv_out"
GDN_FWD_CONV = "gdn_fwd_conv"
# MaxText's toggles -> the names each one expands to.
REMAT_GROUPS = {
    "gdn": (GDN_CORE_ATTN_OUT, GDN_CHUNK_STATES, GDN_T_INV, GDN_QKV, GDN_B, GDN_A),
    "gdn_conv": (GDN_CONV_OUT, GDN_FWD_CONV),
}
# Our residual roles (`remat.call`'s `names`) -> MaxText's names.
MAXTEXT_NAMES = {
    "out": GDN_CORE_ATTN_OUT,
    "states": GDN_CHUNK_STATES,
    "tmats": GDN_T_INV,
    "query": GDN_QKV, "key": GDN_QKV, "value": GDN_QKV,
    "beta": GDN_B,
    "g": GDN_A,
}
# MaxText names that no residual of this function carries, and why.
UNMAPPED = {
    GDN_CONV_OUT: "the causal conv's output: computed before this function, by the layer",
    GDN_FWD_CONV: "the causal conv's forward residual: the layer's conv, not this function",
}


def _check(query, key, value, g, beta, chunk_size, initial_state, cp_axis, compute_dtype):
  name = "jax_chunk_gated_delta_rule"
  arrays = dict(query=query, key=key, value=value, g=g, beta=beta)
  for n, x in arrays.items():
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name}: {n} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name}: {n} must be floating point, got {x.dtype}")
  for n in ("query", "key", "value"):
    if arrays[n].ndim != 4:
      raise ValueError(f"{name}: {n} must be [B, T, H, D], got shape {arrays[n].shape}")
  if query.shape != key.shape:
    raise ValueError(f"{name}: query and key must have one shape [B, T, H, K], got "
                     f"{query.shape} and {key.shape}")
  b, t, h, dk = query.shape
  hv, dv = value.shape[2], value.shape[3]
  if value.shape[:2] != (b, t):
    raise ValueError(f"{name}: value {value.shape} must share [B, T] = {(b, t)} with query")
  if hv % h:
    raise ValueError(f"{name}: value heads ({hv}) must be a multiple of the query/key heads "
                     f"({h}): q/k repeated to the value heads, or not repeated at all")
  for n in ("g", "beta"):
    if arrays[n].shape != (b, t, hv):
      raise ValueError(f"{name}: {n} must be [B, T, Hv] = {(b, t, hv)}, got "
                       f"{arrays[n].shape}")
  if initial_state is not None:
    if not jnp.issubdtype(initial_state.dtype, jnp.floating):
      raise TypeError(f"{name}: initial_state must be floating point, got "
                      f"{initial_state.dtype}")
    if initial_state.shape != (b, hv, dk, dv):
      raise ValueError(f"{name}: initial_state must be [B, Hv, K, V] = {(b, hv, dk, dv)}, "
                       f"got {initial_state.shape}")
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) \
      or chunk_size < 1:
    raise ValueError(f"{name}: chunk_size must be a positive int, got {chunk_size!r}")
  try:
    dtype = jnp.dtype(compute_dtype)
  except TypeError as e:
    raise TypeError(f"{name}: compute_dtype {compute_dtype!r} is not a dtype") from e
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name}: compute_dtype must be floating point, got {dtype}")
  if cp_axis is not None:
    axes = (cp_axis,) if isinstance(cp_axis, str) else cp_axis
    if (not isinstance(axes, (tuple, list)) or not axes
        or not all(isinstance(a, str) for a in axes)):
      raise ValueError(f"{name}: cp_axis must be None, a mesh axis name or a non-empty "
                       f"tuple of them, got {cp_axis!r}")
  return dtype


def _scale(dk: int, dtype) -> float:
  """K**-0.5 as MaxText applies it: rsqrt in float32, rounded to `dtype`."""
  return float(np.asarray(np.float32(1.0) / np.sqrt(np.float32(dk))).astype(dtype))


def jax_chunk_gated_delta_rule(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    chunk_size: int = 64,
    initial_state: jax.Array | None = None,
    use_qk_norm_in_gdn: bool = False,
    cp_axis: str | Sequence[str] | None = None,
    compute_dtype=jnp.bfloat16,
    *,
    implementation: str | Sequence[str] | None = None,
    named_residuals: bool = True,
) -> tuple[jax.Array, jax.Array | None]:
  """MaxText's `jax_chunk_gated_delta_rule` on our kernels (see module doc).

  Args:
    query, key: [B, T, H, K], H = Hv (repeated, as MaxText passes them) or
      any divisor of Hv (not repeated: value head h reads head h // (Hv // H)).
    value: [B, T, Hv, V].
    g: [B, T, Hv] log-decay (<= 0).
    beta: [B, T, Hv] in (0, 1).
    chunk_size: accepted for MaxText's signature (a positive int); our
      implementations choose their own chunk, results do not depend on it.
    initial_state: [B, Hv, K, V] or None.
    use_qk_norm_in_gdn: L2-normalise q and k (eps 1e-6) inside.
    cp_axis: None, or the mesh axis (or tuple of axes) T is sharded over,
      inside `jax.shard_map`.
    compute_dtype: the dtype q, k, v, beta are cast to (default bfloat16).
    implementation: our implementation(s), as `tokamax_gdn.gated_delta_rule`.
    named_residuals: emit the residuals under MaxText's remat names
      (`MAXTEXT_NAMES`); ignored with `cp_axis` and for implementations with
      no analytical backward (the reference: autodiff).

  Returns:
    (out [B, T, Hv, V] in query's dtype, final_state [B, Hv, K, V] in
    `compute_dtype` when `initial_state` is given, else None).
  """
  dtype = _check(query, key, value, g, beta, chunk_size, initial_state, cp_axis,
                 compute_dtype)
  out_dtype = query.dtype
  dk = query.shape[-1]
  q, k, v = query.astype(dtype), key.astype(dtype), value.astype(dtype)
  beta = beta.astype(dtype)
  g = g.astype(jnp.float32)
  s0 = None if initial_state is None else initial_state.astype(jnp.float32)
  kwargs = dict(scale=_scale(dk, dtype), initial_state=s0,
                output_final_state=initial_state is not None,
                use_qk_l2norm=bool(use_qk_norm_in_gdn))
  if cp_axis is not None:
    axis = cp_axis if isinstance(cp_axis, str) else tuple(cp_axis)
    if isinstance(axis, tuple) and len(axis) == 1:
      axis = axis[0]
    out, final = api.gated_delta_rule(q, k, v, g, beta, implementation=implementation,
                                      context_parallel_axis=axis, **kwargs)
  elif named_residuals:
    static = dict(kwargs)
    static.pop("initial_state")

    def run(op):
      if op.vjp is None:      # no analytical backward (the reference): autodiff
        return op(q, k, v, g, beta, initial_state=s0, **static)
      return remat.call(op, q, k, v, g, beta, initial_state=s0, names=MAXTEXT_NAMES,
                        **static)

    out, final = registry.call_each("gated_delta_rule", implementation, run)
  else:
    out, final = api.gated_delta_rule(q, k, v, g, beta, implementation=implementation,
                                      **kwargs)
  out = out.astype(out_dtype)
  if initial_state is None:
    return out, None
  return out, final.astype(dtype)
