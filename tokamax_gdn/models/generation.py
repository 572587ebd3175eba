"""Greedy generation with the decoder: a GDN state pool and a KV cache.

  generate(params, prompts, cfg, max_new_tokens)
    prefill: every prompt in one ragged call (all requests' tokens back to back)
    decode:  one token per request per call, max_new_tokens - 1 calls

Each call is one `step` on a ragged batch in the serving op's layout
(`tokamax_gdn.causal_conv1d_gated_delta_rule`): request r owns tokens
[query_start_loc[r], query_start_loc[r+1]) and pool slot state_indices[r];
distribution = [decode_end, prefill_end, mixed_end], requests past mixed_end
are padding. A `GenerationCache` holds what requests carry from call to call:

  gdn      per GDN block, a conv pool [slots, W-1, conv_dim] and a recurrent
           pool [slots, Hv, K, V], updated by the serving op (it continues a
           slot's state when the request's seq_len exceeds its new tokens);
  kv       per attention block, keys and values [slots, max_len, kv_heads,
           head_dim] (keys after norm and RoPE); each token writes its own at
           its position and attends to its slot's positions up to its own;
  lengths  [slots]: tokens each slot has seen (the next token's position).

Slot 0 is the null slot that padding requests and tokens point at; request r
of `generate` uses slot r + 1. The cache keeps one array per block, not
stacked as the params are, so that each is donated to the jitted step and
the serving op updates it in place. Each step program is compiled with the
cache's layouts left to XLA (`Layout.AUTO`), and the cache is placed in them
on its first call (`step_program`): at the runtime's default layout a bf16 conv
pool has its W-1 axis outermost, and each call relaid every GDN block's pool
out into the serving kernel and back (an ahead-of-time v5e compile of the
qwen3.5-tiny decode step at 64 requests had six such copies; none now).

Everything else in a block (norms, projections, the MoE) is per token, so a
token gets the logits `models.forward` gives it on the whole sequence. The
MoE runs dropless (as with `capacity_factor=None`): with a capacity, routing
would depend on which tokens share a call.
"""

import functools
import math
from typing import NamedTuple, Sequence

import jax
from jax.experimental.layout import Format, Layout
import jax.numpy as jnp
import numpy as np
from tokamax._src.ops import op as op_lib

from tokamax_gdn import registry
from tokamax_gdn.layers.gated_deltanet import in_projection, out_projection  # pylint: disable=g-multiple-import
from tokamax_gdn.models import blocks
from tokamax_gdn.models import decoder
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.api import causal_conv1d_gated_delta_rule

SERVING_OP = "causal_conv1d_gated_delta_rule"
NULL_SLOT = 0


class GenerationCache(NamedTuple):
  """The state of every request slot (a pytree; see the module docstring).

  gdn: one (conv_state, recurrent_state) pool pair per GDN block, in block
    order; kv: one (keys, values) pair per attention block; lengths [slots]
    int32.
  """

  gdn: tuple[tuple[jax.Array, jax.Array], ...]
  kv: tuple[tuple[jax.Array, jax.Array], ...]
  lengths: jax.Array

  @property
  def max_len(self) -> int | None:
    """Positions the KV cache holds (None without attention blocks)."""
    return self.kv[0][0].shape[1] if self.kv else None


def init_cache(cfg: ModelConfig, slots: int, max_len: int, dtype=jnp.float32,
               state_dtype=jnp.float32) -> GenerationCache:
  """Empty pools for `slots` slots (slot 0 included) and `max_len` positions.

  `dtype`: the activations' (conv pools and KV cache); `state_dtype`: the
  recurrent pools' (float32 or bfloat16; the op accumulates in float32).
  """
  if slots < 2:
    raise ValueError(f"`slots`={slots}: need the null slot 0 and at least one request slot.")
  if max_len <= 0:
    raise ValueError(f"`max_len`={max_len} must be positive.")
  g = cfg.gdn
  num_gdn = cfg.num_periods * cfg.gdn_per_period
  num_attn = cfg.num_layers - num_gdn
  gdn = tuple((jnp.zeros((slots, g.conv_kernel_size - 1, g.conv_dim), dtype),
               jnp.zeros((slots, g.num_v_heads, g.head_k_dim, g.head_v_dim), state_dtype))
              for _ in range(num_gdn))
  kv_shape = (slots, max_len, cfg.num_key_value_heads, cfg.head_dim)
  kv = tuple((jnp.zeros(kv_shape, dtype), jnp.zeros(kv_shape, dtype)) for _ in range(num_attn))
  return GenerationCache(gdn=gdn, kv=kv, lengths=jnp.zeros((slots,), jnp.int32))


class _Layout(NamedTuple):
  """Per-call metadata: the serving op's arguments and each token's place."""

  query_start_loc: jax.Array   # [R + 1]
  state_indices: jax.Array     # [R]
  distribution: jax.Array      # [3]
  seq_lens: jax.Array          # [R]: tokens of the request after this call
  query_lens: jax.Array        # [R]: its tokens in this call (0 for padding requests)
  positions: jax.Array         # [N]: each token's position in its sequence (0 for padding)
  token_slots: jax.Array       # [N]: each token's slot (the null slot for padding)


def _layout(lengths, num_tokens, query_start_loc, state_indices, distribution) -> _Layout:
  r = state_indices.shape[0]
  num_valid = distribution[2]
  # Past the last valid request, starts may be anything: pin them to its end
  # (as the op does) so that they stay sorted and own no tokens.
  qsl = jnp.where(jnp.arange(r + 1) <= num_valid, query_start_loc,
                  query_start_loc[num_valid]).astype(jnp.int32)
  query_lens = qsl[1:] - qsl[:-1]
  context = jnp.where(jnp.arange(r) < num_valid, lengths[state_indices], 0)
  token = jnp.arange(num_tokens)
  req = jnp.clip(jnp.searchsorted(qsl, token, side="right") - 1, 0, r - 1)
  valid = token < qsl[num_valid]
  positions = jnp.where(valid, context[req] + token - qsl[req], 0)
  slots = jnp.where(valid, state_indices[req], NULL_SLOT)
  return _Layout(query_start_loc, state_indices, distribution, context + query_lens, query_lens,
                 positions, slots)


def _gdn_block(p, h, pools, lay: _Layout, cfg: ModelConfig, implementation):
  """The GatedDeltaNet mixer on ragged tokens h [N, hidden] through the
  serving op: the layer's own projections around it."""
  g = cfg.gdn
  qkv, z, b, a = in_projection(p, h, g)
  (conv_state, recurrent_state), o = causal_conv1d_gated_delta_rule(
      qkv, b, a, *pools, p["conv_weight"].astype(h.dtype)[:, None, :], None,
      p["a_log"].astype(jnp.float32), p["dt_bias"].astype(jnp.float32),
      lay.query_start_loc, lay.state_indices, lay.distribution, lay.seq_lens,
      n_kq=g.num_k_heads, n_v=g.num_v_heads, d_k=g.head_k_dim, d_v=g.head_v_dim,
      kernel_size=g.conv_kernel_size, implementation=implementation)
  o = o.reshape(h.shape[0], g.num_v_heads, g.head_v_dim)
  return out_projection(p, o, z, g), (conv_state, recurrent_state)


def _attention_block(p, h, kv, lay: _Layout, cfg: ModelConfig):
  """Causal GQA attention of ragged tokens h [N, hidden] over their slots'
  KV cache, after writing their own keys and values into it."""
  heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  n = h.shape[0]
  q, k, v = blocks.attention_qkv(p, h, lay.positions, heads=heads, kv_heads=kv_heads,
                                 head_dim=d, eps=cfg.rms_norm_eps, rope_theta=cfg.rope_theta)
  keys, values = kv
  keys = keys.at[lay.token_slots, lay.positions].set(k.astype(keys.dtype))
  values = values.at[lay.token_slots, lay.positions].set(v.astype(values.dtype))
  kc, vc = keys[lay.token_slots], values[lay.token_slots]          # [N, max_len, kv_heads, d]
  q = q.reshape(n, kv_heads, heads // kv_heads, d)
  s = jnp.einsum("nhgd,nlhd->nhgl", q, kc.astype(h.dtype), preferred_element_type=jnp.float32)
  s = s / math.sqrt(d)
  seen = jnp.arange(keys.shape[1])[None, :] <= lay.positions[:, None]     # [N, max_len]
  s = jnp.where(seen[:, None, None, :], s, -jnp.inf)
  w = jax.nn.softmax(s, axis=-1).astype(h.dtype)
  o = jnp.einsum("nhgl,nlhd->nhgd", w, vc.astype(h.dtype), preferred_element_type=jnp.float32)
  return blocks.matmul(o.astype(h.dtype).reshape(n, heads * d), p["o_proj"]), (keys, values)


def _step(params, cache: GenerationCache, tokens, query_start_loc, state_indices,
          distribution, *, cfg: ModelConfig, serving_impl, gmm_impl, dtype):
  lay = _layout(cache.lengths, tokens.shape[0], query_start_loc, state_indices, distribution)
  dtype = jnp.dtype(dtype or params["embed"].dtype)
  x = jnp.take(params["embed"], tokens, axis=0).astype(dtype)
  dropless = cfg.replace(capacity_factor=None)
  gdn_pools, kv = list(cache.gdn), list(cache.kv)
  for period in range(cfg.num_periods):
    for kind_index, kind in enumerate(cfg.period_kinds):
      if kind == "gdn":
        p = jax.tree.map(lambda a: a[period, kind_index], params["blocks"]["gdn"])
        i = period * cfg.gdn_per_period + kind_index
      else:
        p = jax.tree.map(lambda a: a[period], params["blocks"]["attention"])
        i = period
      h = blocks.rms_norm(x, p["input_norm"], cfg.rms_norm_eps)
      if kind == "gdn":
        h, gdn_pools[i] = _gdn_block(p["gdn"], h, gdn_pools[i], lay, cfg, serving_impl)
      else:
        h, kv[i] = _attention_block(p["attn"], h, kv[i], lay, cfg)
      x, _ = decoder.mlp_residual(p, x + h, dropless, implementation=gmm_impl)
  x = blocks.rms_norm(x, params["final_norm"], cfg.rms_norm_eps)
  head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  logits = jnp.matmul(x, head.astype(dtype), preferred_element_type=jnp.float32)
  lengths = cache.lengths.at[state_indices].add(lay.query_lens)
  return logits, GenerationCache(tuple(gdn_pools), tuple(kv), lengths)


_AUTO = Format(Layout.AUTO)
# Compiled step programs by (static arguments, argument shapes), the most
# recently used last: a server sees a handful of (N, R) shapes.
_PROGRAMS: dict = {}
_MAX_PROGRAMS = 16


def _signature(tree):
  leaves, treedef = jax.tree.flatten(tree)
  return treedef, tuple((x.shape, jnp.dtype(x.dtype), getattr(x, "sharding", None))
                        for x in leaves)


def step_program(params, cache: GenerationCache, args, statics: dict):
  """`_step` compiled for these arguments, the cache donated and its layouts
  (in and out alike) XLA's choice for the program: (compiled, the cache's
  formats as a pytree like `cache`). The program `step` runs (benchmarks time
  this one, placing their cache with `placed`). A cache that `init_cache` left
  uncommitted and the committed one a step returns share the key (their
  sharding on one device is the same); on a mesh the second is a second
  compile."""
  key = (tuple(sorted(statics.items())), _signature((params, cache, args)))
  prog = _PROGRAMS.get(key)
  if prog is None:
    fn = jax.jit(functools.partial(_step, **statics), donate_argnums=(1,),
                 in_shardings=(None, _AUTO) + (None,) * len(args), out_shardings=(None, _AUTO))
    # The cache as shapes: jit refuses concrete arrays whose layout is not the
    # AUTO it is asked to pick; uncommitted ones (`init_cache`'s) follow the
    # params' devices, as they would into a plain jit.
    shapes = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
            x.sharding if getattr(x, "committed", True) else None)), cache)
    compiled = fn.lower(params, shapes, *args).compile()
    formats = compiled.input_formats[0][1]
    if jax.tree.leaves(compiled.output_formats[1]) != jax.tree.leaves(formats):
      # Not seen; it would make every call relayout the cache it is given.
      raise AssertionError("the step's cache layouts differ in and out")
    prog = (compiled, formats)
    while len(_PROGRAMS) >= _MAX_PROGRAMS:
      _PROGRAMS.pop(next(iter(_PROGRAMS)))
  else:
    del _PROGRAMS[key]
  _PROGRAMS[key] = prog
  return prog


def placed(cache: GenerationCache, formats) -> GenerationCache:
  """`cache` in `formats`: arrays already there as they are (the steady
  state, each call's cache being the last one's), others copied once."""
  return jax.tree.map(lambda x, f: x if x.format == f else jax.device_put(x, f), cache, formats)


def _static(op_name: str, implementation):
  """A hashable `implementation=` of `op_name` (sequences become tuples,
  checked as the op checks them)."""
  if implementation is None or isinstance(implementation, (str, op_lib.Op)):
    return implementation
  return registry.candidates(op_name, implementation)


def step(params, cache: GenerationCache, tokens: jax.Array, query_start_loc: jax.Array,
         state_indices: jax.Array, distribution: jax.Array, cfg: ModelConfig, *,
         implementation=None, dtype=None) -> tuple[jax.Array, GenerationCache]:
  """One ragged call: new tokens [N] of R requests -> (logits [N, V] float32, cache).

  The layout is the serving op's (module docstring): request r's tokens
  continue slot state_indices[r] from position `cache.lengths` of that
  slot; a slot just reset (length 0) starts from zeros. `cache` is donated:
  use the returned one. One compiled program per N, R and config, the
  cache in the layouts XLA picks for it (a cache elsewhere, as
  `init_cache` makes it, is copied into them once; the returned one is in
  them).

  Args:
    implementation: as `models.forward` takes it: a name, a sequence, or
      {op name: that} ("causal_conv1d_gated_delta_rule", "gmm").
    dtype: activation dtype (default: the embedding's).
  """
  tokens, query_start_loc, state_indices, distribution = (
      jnp.asarray(a, jnp.int32) for a in (tokens, query_start_loc, state_indices, distribution))
  r = state_indices.shape[0] if state_indices.ndim == 1 else -1
  if (tokens.ndim != 1 or r < 1 or query_start_loc.shape != (r + 1,)
      or distribution.shape != (3,)):
    raise ValueError(
        f"Expected tokens [N], query_start_loc [R + 1], state_indices [R] and distribution [3];"
        f" got shapes {tuple(tokens.shape)}, {tuple(query_start_loc.shape)},"
        f" {tuple(state_indices.shape)}, {tuple(distribution.shape)}.")
  args = (tokens, query_start_loc, state_indices, distribution)
  compiled, formats = step_program(params, cache, args, statics(cfg, implementation, dtype))
  return compiled(params, placed(cache, formats), *args)


def statics(cfg: ModelConfig, implementation=None, dtype=None) -> dict:
  """The static arguments of a step program (`step_program`)."""
  return dict(cfg=cfg,
              serving_impl=_static(SERVING_OP, registry.for_op(implementation, SERVING_OP)),
              gmm_impl=_static("gmm", registry.for_op(implementation, "gmm")),
              dtype=None if dtype is None else jnp.dtype(dtype))


@jax.jit
def _pick(logits, forced):
  return jnp.where(forced >= 0, forced, jnp.argmax(logits, axis=-1)).astype(jnp.int32)


def _prompt_arrays(prompts, vocab_size: int) -> list[np.ndarray]:
  if isinstance(prompts, (np.ndarray, jax.Array)):
    if prompts.ndim != 2:
      raise ValueError(f"`prompts` (shape {tuple(prompts.shape)}): expected [R, T], or a"
                       " sequence of 1-D token sequences.")
    rows = list(np.asarray(prompts))
  else:
    rows = [np.asarray(p) for p in prompts]
  if not rows:
    raise ValueError("`prompts` is empty.")
  for i, row in enumerate(rows):
    if row.ndim != 1 or row.size == 0:
      raise ValueError(f"Prompt {i} (shape {row.shape}): expected a non-empty 1-D token sequence.")
    if not np.issubdtype(row.dtype, np.integer):
      raise ValueError(f"Prompt {i}: tokens must be integers, got {row.dtype}.")
    if row.min() < 0 or row.max() >= vocab_size:
      raise ValueError(f"Prompt {i}: token ids must lie in [0, {vocab_size}).")
  return rows


def generate(params, prompts: Sequence[Sequence[int]] | jax.Array, cfg: ModelConfig,
             max_new_tokens: int, *, implementation=None, forced=None, dtype=None,
             state_dtype=jnp.float32) -> tuple[jax.Array, jax.Array]:
  """Greedy decoding of R prompts, batched: one prefill, then one token per
  request per step.

  Args:
    params: `models.init_params`'s layout.
    prompts: R non-empty 1-D token sequences (lengths may differ), or an
      int array [R, T].
    max_new_tokens: tokens to produce per request.
    implementation: as `models.forward` takes it: a name, a sequence, or
      {op name: that}; the ops are "causal_conv1d_gated_delta_rule" (GDN
      blocks) and "gmm" (MoE).
    forced: optional int [R, max_new_tokens]: where >= 0, that token is
      taken instead of the greedy choice (as the next turn of a dialogue
      would be); its logits are still computed and returned.
    dtype: activation dtype (default: the embedding's); `state_dtype`: the
      recurrent state pools'.

  Returns:
    tokens [R, max_new_tokens] int32 and logits [R, max_new_tokens, V]
    float32: logits[r, i] are the next-token logits after prompt r and
    tokens[r, :i], i.e. `models.forward`'s at that position; tokens[r, i] is
    their argmax, or forced[r, i].
  """
  if max_new_tokens <= 0:
    raise ValueError(f"`max_new_tokens`={max_new_tokens} must be positive.")
  rows = _prompt_arrays(prompts, cfg.vocab_size)
  r = len(rows)
  if forced is None:
    forced = np.full((r, max_new_tokens), -1, np.int32)
  forced = jnp.asarray(forced, jnp.int32)
  if forced.shape != (r, max_new_tokens):
    raise ValueError(f"`forced` (shape {tuple(forced.shape)}): expected"
                     f" [R, max_new_tokens] = {(r, max_new_tokens)}.")
  lens = np.array([row.size for row in rows])
  starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  slots = np.arange(1, r + 1, dtype=np.int32)
  dtype = jnp.dtype(dtype or params["embed"].dtype)
  # The last token is produced, never fed back: no position for it.
  cache = init_cache(cfg, r + 1, int(lens.max()) + max_new_tokens - 1, dtype, state_dtype)
  run = functools.partial(step, params, cfg=cfg, implementation=implementation, dtype=dtype)

  logits, cache = run(cache, np.concatenate(rows), starts, slots, np.array([0, r, r]))
  logits = logits[starts[1:] - 1]
  decode_starts, decode = np.arange(r + 1, dtype=np.int32), np.array([r, r, r])
  out_tokens, out_logits = [], []
  for i in range(max_new_tokens):
    if i:
      logits, cache = run(cache, out_tokens[-1], decode_starts, slots, decode)
    out_tokens.append(_pick(logits, forced[:, i]))
    out_logits.append(logits)
  return jnp.stack(out_tokens, axis=1), jnp.stack(out_logits, axis=1)
