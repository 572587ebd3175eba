"""Flax NNX modules over the pure functions (thin: params as `nnx.Param`s, the
math in `tokamax_gdn.layers` / `tokamax_gdn.models`).

Each module's params are exactly the functional API's dict (`params()` gives
it back), initialised by the same functions (HF's init), so a module and
`gated_deltanet(params, x, cfg)` / `models.block(...)` compute the same thing
bit for bit, and `GatedDeltaNet.from_hf` / `to_hf` use the layer's HF mapping.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from tokamax_gdn import layers
from tokamax_gdn import registry
from tokamax_gdn.models import blocks
from tokamax_gdn.models import decoder
from tokamax_gdn.models.config import ModelConfig

_gmm_implementation = functools.partial(registry.for_op, op_name="gmm")


class _ParamDict(nnx.Module):
  """Holds a flat dict of arrays as `nnx.Param` attributes of the same names."""

  _names: tuple[str, ...] = ()

  def _set_params(self, params: dict[str, Any] | None, init, rngs: nnx.Rngs | None,
                  shapes: dict[str, tuple[int, ...]] | None = None) -> None:
    """`params` as given, else `init(key)` with a key from `rngs`."""
    if params is None:
      if rngs is None:
        raise TypeError(f"{type(self).__name__} needs `rngs` (to initialise) or `params`.")
      params = init(rngs.params())
    if shapes is not None:
      got = {k: tuple(jnp.shape(v)) for k, v in params.items()}
      if got != {k: tuple(v) for k, v in shapes.items()}:
        raise ValueError(f"{type(self).__name__} params: expected shapes {shapes}, got {got}.")
    self._names = tuple(params)
    for name, value in params.items():
      setattr(self, name, nnx.Param(jnp.asarray(value)))

  def params(self) -> dict[str, jax.Array]:
    """The functional API's param dict (current values)."""
    return {name: getattr(self, name)[...] for name in self._names}


class GatedDeltaNet(_ParamDict):
  """The Qwen3-Next / Qwen3.5 GatedDeltaNet layer (`tokamax_gdn.layers.gated_deltanet`).

  `GatedDeltaNet(cfg, rngs=nnx.Rngs(0))` initialises as HF does;
  `GatedDeltaNet.from_hf(state_dict, cfg)` loads one HF `linear_attn` layer.
  """

  def __init__(self, cfg: layers.GatedDeltaNetConfig, *, rngs: nnx.Rngs | None = None,
               dtype=jnp.float32, implementation=None, params: dict[str, Any] | None = None):
    self.cfg = cfg
    self.implementation = implementation
    self._set_params(params, lambda key: layers.init_params(key, cfg, dtype), rngs,
                     layers.param_shapes(cfg))

  def __call__(self, x: jax.Array, *, segment_ids=None, cache=None, return_cache: bool = False):
    return layers.gated_deltanet(self.params(), x, self.cfg, implementation=self.implementation,
                                 segment_ids=segment_ids, cache=cache, return_cache=return_cache)

  @classmethod
  def from_hf(cls, state_dict: dict[str, Any], cfg: layers.GatedDeltaNetConfig, *, dtype=None,
              implementation=None) -> "GatedDeltaNet":
    """From one HF `linear_attn` layer's tensors (see `layers.params_from_hf`)."""
    return cls(cfg, params=layers.params_from_hf(state_dict, cfg, dtype=dtype),
               implementation=implementation)

  def to_hf(self) -> dict[str, Any]:
    """HF names -> NumPy arrays (see `layers.params_to_hf`)."""
    return layers.params_to_hf(self.params(), self.cfg)


class Attention(_ParamDict):
  """Causal GQA softmax attention (`tokamax_gdn.models.attention`); its core
runs as `implementation` says (`models.softmax_attention`)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
               implementation=None, params: dict[str, Any] | None = None):
    self.cfg = cfg
    self.implementation = implementation
    self._set_params(params, lambda key: blocks.init_attention(
        key, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
        dtype), rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.cfg
    return blocks.attention(self.params(), x, heads=c.num_attention_heads,
                            kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                            eps=c.rms_norm_eps, rope_theta=c.rope_theta,
                            implementation=self.implementation)


class MoE(_ParamDict):
  """Routed SwiGLU experts on gmm (`tokamax_gdn.models.moe`); returns (y, stats)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, dtype=jnp.float32,
               implementation=None, params: dict[str, Any] | None = None):
    self.cfg = cfg
    self.implementation = implementation
    self._set_params(params, lambda key: blocks.init_moe(
        key, cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, dtype), rngs)

  def __call__(self, x: jax.Array):
    c = self.cfg
    return blocks.moe(self.params(), x, top_k=c.num_experts_per_tok,
                      capacity_factor=c.capacity_factor, norm_topk_prob=c.norm_topk_prob,
                      implementation=self.implementation)


class DecoderBlock(nnx.Module):
  """RMSNorm -> GatedDeltaNet (or attention) -> residual, RMSNorm -> MoE ->
  residual (`tokamax_gdn.models.block`); returns (x, MoE stats)."""

  def __init__(self, cfg: ModelConfig, kind: str = "gdn", *, rngs: nnx.Rngs,
               dtype=jnp.float32, implementation=None):
    p = decoder.init_block(rngs.params(), cfg, kind, dtype)
    self.cfg, self.kind, self.implementation = cfg, kind, implementation
    self.input_norm = nnx.Param(p["input_norm"])
    self.post_norm = nnx.Param(p["post_norm"])
    if kind == "gdn":
      self.mixer = GatedDeltaNet(cfg.gdn, params=p["gdn"], implementation=implementation)
    else:
      self.mixer = Attention(cfg, params=p["attn"], implementation=implementation)
    self.moe = MoE(cfg, params=p["moe"], implementation=_gmm_implementation(implementation))

  def params(self) -> dict[str, Any]:
    """The functional block's param dict."""
    return dict(input_norm=self.input_norm[...], post_norm=self.post_norm[...],
                moe=self.moe.params(),
                **{"gdn" if self.kind == "gdn" else "attn": self.mixer.params()})

  def __call__(self, x: jax.Array):
    return decoder.block(self.params(), x, self.cfg, self.kind,
                         implementation=self.implementation)
