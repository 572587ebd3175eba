"""vLLM TPU drop-in: `fused_conv1d_gdn` on tokamax_gdn's serving op.

vLLM's TPU backend, tpu-inference (0.32.0), runs the GDN layers of hybrid
models (Qwen3-Next, Qwen3.5) through one fused kernel,
`tpu_inference.kernels.gdn.v3.wrapper.fused_conv1d_gdn`, which its
`GDNLinearAttentionBackend.conv1d_gdn_kernel()` hands to the layers
(`tpu_inference/layers/common/gdn_attention.py` shard-maps it over the
attention heads). This module's `fused_conv1d_gdn` has the same signature
and returns the same ((new_conv_state, new_recurrent_state), out), running
`tokamax_gdn.causal_conv1d_gated_delta_rule` (the Pallas TPU kernels on a
TPU, the XLA version elsewhere), so a server switches by replacing that one
function (docs/serving.md, "Routing vLLM's GDN layers here").

The positional arguments and num_spec_tokens are our op's convention (it is
tokamax 0.0.17's, which vLLM's kernel shares) with two differences that
vLLM 0.32.0's kernel has and this function reproduces:
  - `read_state_indices` is positional with no default (vLLM's layers always
    pass it; None is accepted here and means `state_indices`).
  - `read_offsets` move only the reads of the decode segment's requests
    (r < distribution[0], the verify windows): vLLM's kernel reads a
    prefill or mixed request's initial state from `read_state_indices[r]`
    whatever its offset, where tokamax's and ours add the offset to every
    request's read slot. The offsets past decode_end are zeroed here.

The four extra keywords, and what they mean here:
  - `zero_initialize_out` (bool): in vLLM, whether the output buffer starts
    zeroed, so that rows of tokens outside every valid request (padding) are
    zero rather than undefined. Ours always returns zeros there, which is
    what both values allow: accepted, and True in effect.
  - `compute_precision` (a dtype, float32 or bfloat16): in vLLM, the dtype
    its kernel casts q, k, v and the gates to for the GDN arithmetic. Ours
    accumulates and carries the state in float32 whatever the inputs
    (DESIGN.md, numerical contract), so bfloat16 gives float32 results
    here: accepted and ignored; other dtypes are refused.
  - `decode_tile_size`, `mixed_tile_size` (positive ints): vLLM's own
    kernel's tiles (sequences per decode grid step, tokens per prefill
    tile). Ours picks its tiles per shape and chip (heuristics, or a tuned
    config from `tokamax-gdn autotune`), and vLLM's defaults are not ours'
    best (a decode tile of 4 runs as 8 in our kernel, and 64-token prefill
    tiles would halve our chunk of 128): validated and ignored. To pin our
    tiling, call `tokamax_gdn.causal_conv1d_gated_delta_rule` with a
    configured Op as `implementation`.

Like vLLM's, the function is jitted with both pools donated (updated in
place when the caller donates them) and the sizes and keywords static.

`tpu_inference_kernel()` loads vLLM's own function, to run beside this one
(`tokamax-gdn bench --op causal_conv1d_gated_delta_rule` on a TPU).
"""

import importlib
import importlib.util
import os
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api

# Compute dtypes vLLM's kernel is run with (its default float32, and bfloat16).
COMPUTE_PRECISIONS = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _check_keywords(zero_initialize_out, compute_precision, decode_tile_size,
                    mixed_tile_size) -> None:
  """Clear errors for values vLLM's kernel would not take either."""
  if not isinstance(zero_initialize_out, (bool, np.bool_)):
    raise ValueError(f"zero_initialize_out must be a bool; got {zero_initialize_out!r}.")
  try:
    dtype = jnp.dtype(compute_precision)
  except TypeError:
    dtype = None
  if dtype not in COMPUTE_PRECISIONS:
    raise ValueError(f"compute_precision must be float32 or bfloat16; got {compute_precision!r}.")
  for name, value in (("decode_tile_size", decode_tile_size),
                      ("mixed_tile_size", mixed_tile_size)):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
      raise ValueError(f"{name} must be a positive int; got {value!r}.")


@jax.jit(
    donate_argnames=("conv_state", "recurrent_state"),
    static_argnames=("n_kq", "n_v", "d_k", "d_v", "kernel_size", "num_spec_tokens",
                     "decode_tile_size", "mixed_tile_size", "zero_initialize_out",
                     "compute_precision"),
)
def fused_conv1d_gdn(
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
    read_state_indices: jax.Array,
    read_offsets: jax.Array | None = None,
    *,
    n_kq: int,
    n_v: int,
    d_k: int,
    d_v: int,
    kernel_size: int,
    num_spec_tokens: int = 0,
    zero_initialize_out: bool = True,
    compute_precision: jnp.dtype = jnp.float32.dtype,
    decode_tile_size: int = 4,
    mixed_tile_size: int = 64,
) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
  """Fused causal conv1d + gated delta rule on state pools, as vLLM TPU's
  `fused_conv1d_gdn` (tpu-inference 0.32.0), on tokamax_gdn's serving op.

  Args:
    qkv: [T, 2 n_kq d_k + n_v d_v] raw (pre-conv) q, k, v of T packed tokens.
    b, a: [T, n_v] raw beta / gate inputs.
    conv_state: [S, kernel_size - 1, dim] pool (bf16 or f32); slot 0 is the
      null slot of padding requests.
    recurrent_state: [S, n_v, d_k, d_v] pool (bf16 or f32).
    conv_weight: [dim, 1, kernel_size]; conv_bias: [dim] or None.
    a_log, dt_bias: [n_v].
    query_start_loc: [R + 1]: request r owns tokens [qsl[r], qsl[r + 1]).
    state_indices: [R]: request r's slot (the first of num_spec_tokens + 1
      consecutive checkpoint slots for the decode segment's requests).
    distribution: [3] [decode_end, prefill_end, mixed_end]; requests from
      mixed_end on are padding.
    seq_lens: [R]: a request continues its read slot's states when seq_lens[r]
      exceeds its token count, else starts from zeros.
    read_state_indices: [R]: the slot each request reads (None:
      state_indices).
    read_offsets: [R] or None: added to the read slot of the decode segment's
      requests only (module doc); required with num_spec_tokens > 0.
    n_kq, n_v, d_k, d_v, kernel_size: static sizes (n_v a multiple of n_kq).
    num_spec_tokens: draft tokens per verify window (0: one-token decodes).
    zero_initialize_out, compute_precision, decode_tile_size,
      mixed_tile_size: vLLM's kernel's knobs, validated; see the module doc
      for what each means here.

  Returns:
    ((new_conv_state, new_recurrent_state) in the pools' dtypes,
     out [T, n_v d_v] in qkv's dtype, zero for tokens of no valid request).
  """
  _check_keywords(zero_initialize_out, compute_precision, decode_tile_size, mixed_tile_size)
  if read_offsets is not None:
    decode = jnp.arange(state_indices.shape[0]) < distribution[0]
    read_offsets = jnp.where(decode, read_offsets, jnp.zeros_like(read_offsets))
  return api.causal_conv1d_gated_delta_rule(
      qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
      query_start_loc, state_indices, distribution, seq_lens, read_state_indices, read_offsets,
      n_kq=n_kq, n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size,
      num_spec_tokens=num_spec_tokens)


# The packages above tpu-inference's GDN v3 kernel, whose `__init__`s it does
# not need (`tpu_inference_kernel`).
_PARENTS = (("tpu_inference", ""), ("tpu_inference.kernels", "kernels"),
            ("tpu_inference.kernels.gdn", os.path.join("kernels", "gdn")))
_KERNEL_MODULE = "tpu_inference.kernels.gdn.v3.wrapper"


def tpu_inference_kernel():
  """vLLM's own `fused_conv1d_gdn` (tpu-inference's GDN v3 kernel), from
  tpu-inference's files wherever they are on the path (its wheel unzipped
  onto PYTHONPATH will do).

  Where the `tpu_inference` package is not imported yet, its parent packages
  are entered as bare namespaces: their `__init__`s import vLLM itself (and
  through it torch), set XLA and libtpu flags in the environment and may ask
  the cloud metadata server for the TPU type, none of which the kernel,
  whose modules import only JAX, needs. Raises ImportError where
  tpu-inference is not found.
  """
  if "tpu_inference" not in sys.modules:
    spec = importlib.util.find_spec("tpu_inference")
    if spec is None or not spec.submodule_search_locations:
      raise ImportError("tpu-inference is not on the path (unzip its wheel onto PYTHONPATH)")
    root = list(spec.submodule_search_locations)[0]
    for name, sub in _PARENTS:
      if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [os.path.join(root, sub)]
        sys.modules[name] = module
  return importlib.import_module(_KERNEL_MODULE).fused_conv1d_gdn
