"""The Qwen3-Next / Qwen3.5 GatedDeltaNet block (HF `linear_attn`), in JAX.

Per token x [hidden] (r = Hv / Hk value heads per key head):

  [q k v | z | b | a] = x @ in_proj            q, k: Hk*K; v, z: Hv*V; b, a: Hv
  [q k v] = silu(causal_conv1d([q k v], conv_weight))   (depthwise, W taps, no bias)
  beta    = sigmoid(b);   g = -exp(a_log) * softplus(a + dt_bias)
  o       = gated_delta_rule(q, k, v, g, b, use_qk_l2norm=True,
                             use_beta_sigmoid=True)   (scale K**-0.5)
  o       = rmsnorm(o, eps) * norm_weight * silu(z)      (per value head, over V)
  y       = o @ out_proj

Both HF variants compute exactly this; they differ only in how the input
projection is stored. Qwen3.5 keeps four matrices (`in_proj_qkv`, `in_proj_z`,
`in_proj_b`, `in_proj_a`); Qwen3-Next fuses them into two, interleaved per key
head: `in_proj_qkvz` rows are [q_h (K), k_h (K), v_h (r*V), z_h (r*V)] for each
key head h, `in_proj_ba` rows are [b_h (r), a_h (r)]. The parameters here hold
one fused, de-interleaved `in_proj` [hidden, 2*Hk*K + 2*Hv*V + 2*Hv]
(`in_proj_bounds`; the layer projects it by column groups, `conv_groups`),
whatever the variant; `hf.params_from_hf` /
`hf.params_to_hf` do the (linear, so also gradient-exact) re-layout.

The gated RMSNorm follows HF to the cast: normalise in float32, cast back to
the activation dtype, multiply by the weight, then by silu(z) in float32.
"""

import dataclasses
import functools
import os
import typing
from typing import Any, NamedTuple

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
import numpy as np
from tokamax._src.ops import op as op_lib

from tokamax_gdn import registry
from tokamax_gdn.layers import presets
from tokamax_gdn.ops.causal_conv1d.api import causal_conv1d
from tokamax_gdn.ops.gated_delta_rule import remat as gdn_remat
from tokamax_gdn.ops.gated_delta_rule import xla as gdn_xla
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.ops.gated_rmsnorm.api import gated_rmsnorm as gated_rmsnorm_op

VARIANTS = ("qwen3_next", "qwen3_5")
Params = dict[str, jax.Array]


# What `chunk_size` may pin: the xla GDN Config's own choices.
CHUNK_SIZES = typing.get_args(typing.get_type_hints(gdn_xla.Config)["chunk_size"])


@dataclasses.dataclass(frozen=True)
class GatedDeltaNetConfig:
  """Shapes and knobs of one GatedDeltaNet layer (hashable: usable as a jit static)."""

  hidden_size: int
  num_k_heads: int
  num_v_heads: int
  head_k_dim: int = 128
  head_v_dim: int = 128
  conv_kernel_size: int = 4
  rms_norm_eps: float = 1e-6
  # Pins the xla GDN's chunk size; None: the op's tuned or heuristic config.
  chunk_size: int | None = None
  use_gdn_kernel: bool = True   # prefer the Pallas TPU kernels when available
  variant: str = "qwen3_5"      # HF weight layout: "qwen3_next" or "qwen3_5"

  def __post_init__(self):
    if self.variant not in VARIANTS:
      raise ValueError(f"`variant`={self.variant!r}: expected one of {VARIANTS}.")
    if self.num_k_heads <= 0 or self.num_v_heads % self.num_k_heads:
      raise ValueError(
          f"`num_v_heads`={self.num_v_heads} must be a positive multiple of"
          f" `num_k_heads`={self.num_k_heads}.")
    if self.conv_kernel_size < 1:
      raise ValueError(f"`conv_kernel_size`={self.conv_kernel_size} must be >= 1.")
    if self.chunk_size is not None and self.chunk_size not in CHUNK_SIZES:
      raise ValueError(f"`chunk_size`={self.chunk_size!r}: the xla GDN's chunk sizes are"
                       f" {CHUNK_SIZES} (or None for its tuned / heuristic choice).")

  @property
  def key_dim(self) -> int:
    return self.num_k_heads * self.head_k_dim

  @property
  def value_dim(self) -> int:
    return self.num_v_heads * self.head_v_dim

  @property
  def conv_dim(self) -> int:
    return 2 * self.key_dim + self.value_dim

  @property
  def in_proj_dim(self) -> int:
    return self.conv_dim + self.value_dim + 2 * self.num_v_heads

  @classmethod
  def from_hf_config(cls, d: dict[str, Any] | Any, variant: str | None = None,
                     **overrides) -> "GatedDeltaNetConfig":
    """From an HF `config.json` dict (or config object; `text_config` is followed).

    `variant` defaults to what `model_type` says ("qwen3_next*" or "qwen3_5*").
    """
    if not isinstance(d, dict):
      d = d.to_dict() if hasattr(d, "to_dict") else vars(d)
    model_type = str(d.get("model_type", ""))
    if "text_config" in d and "hidden_size" not in d:
      d = d["text_config"]
      model_type = model_type or str(d.get("model_type", ""))
    if variant is None:
      variant = next((v for v in VARIANTS if model_type.startswith(v)), None)
      if variant is None:
        raise ValueError(
            f"Cannot tell the variant from model_type={model_type!r}; pass"
            f" `variant=` one of {VARIANTS}.")
    kw = dict(
        hidden_size=int(d["hidden_size"]),
        num_k_heads=int(d["linear_num_key_heads"]),
        num_v_heads=int(d["linear_num_value_heads"]),
        head_k_dim=int(d["linear_key_head_dim"]),
        head_v_dim=int(d["linear_value_head_dim"]),
        conv_kernel_size=int(d["linear_conv_kernel_dim"]),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        variant=variant,
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "GatedDeltaNetConfig":
    names = {f.name for f in dataclasses.fields(cls)}
    # A preset's `model:` section describes the decoder around the layer
    # (tokamax_gdn.models.ModelConfig), not the layer.
    unknown = set(d) - names - {"name", "model"}
    if unknown:
      raise ValueError(f"Unknown GatedDeltaNetConfig keys {sorted(unknown)}; valid: {sorted(names)}.")
    missing = [f.name for f in dataclasses.fields(cls)
               if f.default is dataclasses.MISSING and f.name not in d]
    if missing:
      raise ValueError(f"GatedDeltaNetConfig fields {missing} are missing.")
    return cls(**{k: v for k, v in d.items() if k in names})

  @classmethod
  def from_yaml(cls, path) -> "GatedDeltaNetConfig":
    """From a preset file (keys = field names, plus an optional `name`);
    a ValueError naming the file for a missing, malformed or incomplete one."""
    return presets.read_preset(path, cls.from_dict)


def load_preset(spec: str | os.PathLike[str], **overrides) -> GatedDeltaNetConfig:
  """`load_preset("qwen3.5-tiny")` (a name or a .yml path, see `preset_file`);
  keyword overrides replace fields."""
  cfg = GatedDeltaNetConfig.from_yaml(presets.preset_file(spec))
  if overrides:
    cfg = dataclasses.replace(cfg, **overrides)
  return cfg


class GatedDeltaNetCache(NamedTuple):
  """What a sequence carries between calls (a pytree).

  conv_state: [B, W-1, 2*Hk*K + Hv*V], the last W-1 conv inputs (activation dtype).
  recurrent_state: [B, Hv, K, V] float32 (one of another float dtype is
    read as float32, as `gated_delta_rule` reads its `initial_state`; the
    returned cache's is float32).
  """

  conv_state: jax.Array
  recurrent_state: jax.Array

  @classmethod
  def zeros(cls, batch: int, cfg: GatedDeltaNetConfig, dtype=jnp.float32) -> "GatedDeltaNetCache":
    return cls(
        jnp.zeros((batch, cfg.conv_kernel_size - 1, cfg.conv_dim), dtype),
        jnp.zeros((batch, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim), jnp.float32))


# ----------------------------------------------------------------------------
# Parameters.

def param_shapes(cfg: GatedDeltaNetConfig) -> dict[str, tuple[int, ...]]:
  return dict(
      in_proj=(cfg.hidden_size, cfg.in_proj_dim),
      conv_weight=(cfg.conv_dim, cfg.conv_kernel_size),
      dt_bias=(cfg.num_v_heads,),
      a_log=(cfg.num_v_heads,),
      norm_weight=(cfg.head_v_dim,),
      out_proj=(cfg.value_dim, cfg.hidden_size),
  )


def init_params(key: jax.Array, cfg: GatedDeltaNetConfig, dtype=jnp.float32) -> Params:
  """Random parameters as HF initialises them (normal(0.02) matrices,
  kaiming-uniform conv, A ~ U(0.01, 16), dt_bias = 1, norm weight = 1)."""
  k_in, k_conv, k_a, k_out = jax.random.split(key, 4)
  w = cfg.conv_kernel_size
  conv_bound = 1.0 / np.sqrt(w)   # PyTorch Conv1d default: fan_in = W for depthwise.
  return dict(
      in_proj=(0.02 * jax.random.normal(k_in, (cfg.hidden_size, cfg.in_proj_dim))).astype(dtype),
      conv_weight=jax.random.uniform(k_conv, (cfg.conv_dim, w), dtype, -conv_bound, conv_bound),
      dt_bias=jnp.ones((cfg.num_v_heads,), jnp.float32),     # gate params: always f32
      a_log=jnp.log(jax.random.uniform(k_a, (cfg.num_v_heads,), jnp.float32, 0.01, 16.0)),
      norm_weight=jnp.ones((cfg.head_v_dim,), dtype),
      out_proj=(0.02 * jax.random.normal(k_out, (cfg.value_dim, cfg.hidden_size))).astype(dtype),
  )


def in_proj_bounds(cfg: GatedDeltaNetConfig) -> tuple[int, ...]:
  """Column offsets of `in_proj`'s parts [q k v | z | b | a]: q starts at 0,
  k at the second offset, ..., a ends at the last."""
  kd, vd, hv = cfg.key_dim, cfg.value_dim, cfg.num_v_heads
  return (0, kd, 2 * kd, cfg.conv_dim, cfg.conv_dim + vd, cfg.conv_dim + vd + hv,
          cfg.in_proj_dim)


def split_in_proj(w, cfg: GatedDeltaNetConfig):
  """Columns of `in_proj` -> (qkv, z, b, a)."""
  _, _, _, c, z_end, b_end, _ = in_proj_bounds(cfg)
  return w[..., :c], w[..., c:z_end], w[..., z_end:b_end], w[..., b_end:]


# ----------------------------------------------------------------------------
# Forward.

def _implementations(op_name: str, implementation, cfg: GatedDeltaNetConfig):
  """The `implementation=` for one op, from the layer's argument and config."""
  implementation = registry.for_op(implementation, op_name)
  if implementation is not None:
    names = registry.candidates(op_name, implementation)
  else:
    available = registry.implementations(op_name)
    wanted = ("pallas_mosaic_tpu", "xla") if cfg.use_gdn_kernel else ("xla",)
    names = tuple(n for n in wanted if n in available) or registry.default_order(op_name)
  if op_name == "gated_delta_rule" and cfg.chunk_size is not None:
    names = tuple(_with_chunk_size(n, cfg.chunk_size) for n in names)
  # One named implementation stays one (its own error if it cannot run, not
  # an ExceptionGroup of one).
  return names[0] if isinstance(implementation, (str, op_lib.Op)) else names


def _with_chunk_size(impl, chunk_size: int):
  """The xla GDN Op with its chunk size fixed to `chunk_size` (others unchanged)."""
  if impl != "xla" or "xla" not in registry.implementations("gated_delta_rule"):
    return impl
  op = registry.get("gated_delta_rule", "xla")
  try:
    cfg = type(op).config_cls(chunk_size=chunk_size)
  except (TypeError, ValueError):   # pydantic's ValidationError is a ValueError
    return impl      # no such knob (or not this value): the op's own choice.
  kw = dict(config=cfg)
  vjp = getattr(op, "vjp", None)
  if vjp is not None:
    try:
      kw["vjp"] = vjp.replace(config=type(vjp).config_cls(chunk_size=chunk_size))
    except (TypeError, ValueError):
      pass
  return op.replace(**kw)


def gated_rmsnorm(o: jax.Array, z: jax.Array, weight: jax.Array, eps: float, *,
                  implementation=None) -> jax.Array:
  """HF Qwen3NextRMSNormGated (see module docstring) over each group of V =
  len(weight) elements of the last axis: the `tokamax_gdn.gated_rmsnorm` op
  (o, z [..., H·V], weight [V]; the result in o's dtype)."""
  return gated_rmsnorm_op(o, z, weight, eps=eps, implementation=implementation)


def _slices(x: jax.Array, bounds: tuple[int, ...], axis: int) -> tuple[jax.Array, ...]:
  return tuple(jax.lax.slice_in_dim(x, a, b, axis=axis) for a, b in zip(bounds, bounds[1:]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def split(x: jax.Array, bounds: tuple[int, ...], axis: int) -> tuple[jax.Array, ...]:
  """x's slices [bounds[i], bounds[i+1]) along `axis`; the VJP concatenates
  the cotangents (autodiff would pad each one to x's shape and add them, in
  float32 for low-precision x)."""
  return _slices(x, bounds, axis)


split.defvjp(lambda x, bounds, axis: (split(x, bounds, axis), None),
             lambda bounds, axis, _, cts: (jnp.concatenate(cts, axis=axis),))


def _matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w in x's dtype, accumulated in float32."""
  return jnp.einsum("...h,hp->...p", x, w.astype(x.dtype),
                    preferred_element_type=jnp.float32).astype(x.dtype)


def in_projection(params: Params, x: jax.Array, cfg: GatedDeltaNetConfig):
  """x [..., hidden] -> (qkv, z, b, a), x's dtype: the conv input qkv
  [..., 2*Hk*K + Hv*V] (head-major q | k | v, the serving op's `qkv` layout),
  the output gate z [..., Hv*V] and the beta / decay gate inputs b, a [..., Hv]."""
  return split_in_proj(_matmul(x, params["in_proj"]), cfg)


# TPU vector lanes: a channel group of the conv input that spans whole lane
# tiles is an array of its own without padding or relayout.
_LANES = 128


def conv_groups(cfg: GatedDeltaNetConfig) -> tuple[int, ...]:
  """Bounds of the conv input's channel groups in `gated_deltanet`: q | k | v
  when each spans whole 128-lane tiles, else q k v as one group.

  Each group is projected by a matmul of its own, convolved by a conv of its
  own and handed to the GDN op as it is: with one projection for the whole
  `in_proj`, the conv input and the GDN op's q, k and v were slice copies of
  the projection and of the conv output, and in the backward their
  cotangents were assembled into the projection's (pads and adds in float32,
  a concatenation fused into the projection's matmul). Unaligned groups
  would each be padded to whole lanes by the conv instead.
  """
  kd = cfg.key_dim
  if kd % _LANES == 0 and cfg.value_dim % _LANES == 0:
    return (0, kd, 2 * kd, cfg.conv_dim)
  return (0, cfg.conv_dim)


def out_projection(params: Params, o: jax.Array, z: jax.Array,
                   cfg: GatedDeltaNetConfig, implementation=None) -> jax.Array:
  """GDN output o [..., Hv, V] and gate z [..., Hv*V] -> y [..., hidden] in
  z's dtype: the gated RMSNorm per value head (`implementation=` as the
  layer's), then `out_proj`."""
  dtype = z.dtype
  lead = z.shape[:-1]
  # Flat [..., Hv·V], as the GDN kernels write o and the projection writes z:
  # the op normalises each value head's V (groups of V), with no relayout.
  o = gated_rmsnorm(o.astype(dtype).reshape(*lead, cfg.value_dim), z,
                    params["norm_weight"].astype(dtype), cfg.rms_norm_eps,
                    implementation=_implementations("gated_rmsnorm", implementation, cfg))
  return _matmul(o, params["out_proj"])


def gated_deltanet(
    params: Params,
    x: jax.Array,
    cfg: GatedDeltaNetConfig,
    *,
    implementation=None,
    segment_ids: jax.Array | None = None,
    cache: GatedDeltaNetCache | None = None,
    return_cache: bool = False,
    context_parallel_axis: str | None = None,
    named_residuals: bool = False,
):
  """The GatedDeltaNet block: x [B, T, hidden] -> y [B, T, hidden] (x's dtype).

  Args:
    params: from `init_params` or `hf.params_from_hf`.
    x: [B, T, hidden] activations.
    cfg: the layer's shapes.
    implementation: for `causal_conv1d`, `gated_delta_rule` and `gated_rmsnorm`: a
      name, a sequence of names tried in order, or a dict {op name: a name, a
      tokamax Op or a sequence of those}; anything else is a TypeError naming
      the valid names. None:
      ("pallas_mosaic_tpu", "xla") when `cfg.use_gdn_kernel` else "xla",
      restricted to what the registry has.
    segment_ids: [B, T] int for packed sequences; conv windows and the
      recurrent state restart where the id changes.
    cache: state after earlier tokens of the same sequences (prefill then
      decode); None starts from zeros.
    return_cache: also return the `GatedDeltaNetCache` after the last token.
    context_parallel_axis: inside `jax.shard_map` with T of `x` (and
      `segment_ids`) sharded over this mesh axis: passed to both ops (see
      `gated_delta_rule`); the rest of the layer is per token. The returned
      cache is then the whole sequence's, on every device of the axis, and a
      given `cache` enters at the first token (pass it replicated).
    named_residuals: passed to `gated_delta_rule`: its forward emits the
      backward's residuals under `checkpoint_name`s for a `jax.checkpoint`
      policy (`ops.gated_delta_rule.remat`). The conv output is always named
      `gdn_conv_out`.

  Returns:
    y, or (y, cache) with `return_cache`.
  """
  b, t, hidden = x.shape
  if hidden != cfg.hidden_size:
    raise ValueError(f"`x` (shape {tuple(x.shape)}): last axis must be hidden_size={cfg.hidden_size}.")
  dtype = x.dtype
  hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim

  groups = conv_groups(cfg)
  n = len(groups) - 1
  bounds = in_proj_bounds(cfg)
  # The in-projection by parts: each conv group's columns, then z's, then b|a's.
  # Plain slices: autodiff's pads of their gradients fuse into the optimizer's
  # update, where a concatenation fixed a layout of its own and relaid the
  # parameter out. (Slicing the weight cast to the activation dtype made XLA
  # write the whole cast weight and its slices.)
  w_parts = _slices(params["in_proj"], groups + (bounds[4], bounds[6]), 1)
  conv_weights = _slices(params["conv_weight"], groups, 0)
  conv_states = ((None,) * n if cache is None
                 else split(cache.conv_state.astype(dtype), groups, cache.conv_state.ndim - 1))
  conv_impl = _implementations("causal_conv1d", implementation, cfg)
  conv_out, new_conv_states = [], []
  for w_part, conv_weight, conv_state in zip(w_parts, conv_weights, conv_states):
    y, final = causal_conv1d(
        _matmul(x, w_part), conv_weight.astype(dtype), None,
        activation="silu",
        initial_state=conv_state,
        output_final_state=return_cache,
        segment_ids=segment_ids,
        implementation=conv_impl,
        context_parallel_axis=context_parallel_axis,
    )
    conv_out.append(checkpoint_name(y, gdn_remat.CONV_OUT))
    new_conv_states.append(final)
  q, k, v = conv_out if n == 3 else split(conv_out[0], bounds[:4], 2)
  q, k, v = q.reshape(b, t, hk, dk), k.reshape(b, t, hk, dk), v.reshape(b, t, hv, dv)
  z = _matmul(x, w_parts[n])
  beta_logit, a = split(_matmul(x, w_parts[n + 1]), (0, hv, 2 * hv), 2)
  o, new_state = gated_delta_rule(
      q, k, v, a, beta_logit,
      initial_state=None if cache is None else cache.recurrent_state,
      output_final_state=return_cache,
      use_qk_l2norm=True,
      use_beta_sigmoid=True,   # beta = sigmoid(b), in the op (in VMEM in the kernels)
      a_log=params["a_log"].astype(jnp.float32),
      dt_bias=params["dt_bias"].astype(jnp.float32),
      segment_ids=segment_ids,
      implementation=_implementations("gated_delta_rule", implementation, cfg),
      context_parallel_axis=context_parallel_axis,
      named_residuals=named_residuals,
  )
  y = out_projection(params, o, z, cfg, implementation)
  if return_cache:
    return y, GatedDeltaNetCache(jnp.concatenate(new_conv_states, axis=-1), new_state)
  return y
