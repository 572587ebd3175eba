"""`ModelConfig`: the shapes of a Qwen3.5-style hybrid decoder.

A preset file (`configs/models/<name>.yml`) holds the GatedDeltaNet layer's
fields at the top level (what `tokamax_gdn.layers.load_preset` reads) and the
decoder around it under a `model:` section:

    hidden_size: 256          # ... the GatedDeltaNetConfig fields
    model:
      num_layers: 4
      full_attention_interval: 4
      num_attention_heads: 4
      ...

`ModelConfig.load("qwen3.5-micro")` (a preset name or a .yml path) reads both.
"""

import dataclasses
from typing import Any


from tokamax_gdn.layers import presets
from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig

MODEL_SECTION = "model"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder shapes (hashable: usable as a jit static argument).

  Block i (0-based) is causal softmax attention when
  `full_attention_interval` > 0 and (i + 1) % full_attention_interval == 0,
  else GatedDeltaNet (Qwen3-Next / Qwen3.5 use 4: three GDN blocks, then one
  attention block). The blocks of one interval form a *period* (all blocks
  form one period when the interval is 0); the decoder scans over periods and,
  inside a period, over its GDN blocks, so `num_layers` must be a multiple of
  the interval.

  MoE capacity: `capacity_factor=None` is dropless (every token reaches its
  top-k experts; the router's group sizes sum to exactly tokens * top_k rows).
  With a factor c, expert e keeps the first ceil(c * tokens * top_k / E) of
  its assignments in token order and drops the rest: dropped rows are sorted
  past sum(group_sizes), where gmm writes zeros, so a dropped assignment adds
  nothing (the block's residual carries the token on).
  """

  gdn: GatedDeltaNetConfig
  num_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int
  num_experts: int
  num_experts_per_tok: int
  moe_intermediate_size: int
  vocab_size: int = 256
  full_attention_interval: int = 4
  rope_theta: float = 10000.0
  capacity_factor: float | None = None
  router_aux_loss_coef: float = 1e-3
  norm_topk_prob: bool = True
  tie_word_embeddings: bool = False
  name: str = ""

  def __post_init__(self):
    def positive(field):
      if getattr(self, field) <= 0:
        raise ValueError(f"`{field}`={getattr(self, field)} must be positive.")
    for f in ("num_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "vocab_size"):
      positive(f)
    if self.full_attention_interval < 0 or self.full_attention_interval == 1:
      raise ValueError(
          f"`full_attention_interval`={self.full_attention_interval} must be 0 (no attention"
          " blocks) or >= 2 (a GatedDeltaNet model needs GDN blocks).")
    if self.num_layers % self.period:
      raise ValueError(
          f"`num_layers`={self.num_layers} must be a multiple of"
          f" `full_attention_interval`={self.full_attention_interval}.")
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(
          f"`num_attention_heads`={self.num_attention_heads} must be a multiple of"
          f" `num_key_value_heads`={self.num_key_value_heads}.")
    if self.num_experts_per_tok > self.num_experts:
      raise ValueError(
          f"`num_experts_per_tok`={self.num_experts_per_tok} exceeds"
          f" `num_experts`={self.num_experts}.")
    if self.head_dim % 2:
      raise ValueError(f"`head_dim`={self.head_dim} must be even (rotary embedding).")
    if self.capacity_factor is not None and self.capacity_factor <= 0:
      raise ValueError(f"`capacity_factor`={self.capacity_factor} must be positive or None.")

  @property
  def hidden_size(self) -> int:
    return self.gdn.hidden_size

  @property
  def rms_norm_eps(self) -> float:
    return self.gdn.rms_norm_eps

  @property
  def period(self) -> int:
    """Blocks per period: GDN blocks, then (with an interval) one attention block."""
    return self.full_attention_interval or self.num_layers

  @property
  def num_periods(self) -> int:
    return self.num_layers // self.period

  @property
  def gdn_per_period(self) -> int:
    return self.period - 1 if self.full_attention_interval else self.period

  @property
  def period_kinds(self) -> tuple[str, ...]:
    """"gdn" or "attention" for each block of a period."""
    return ("gdn",) * self.gdn_per_period + ("attention",) * (self.period - self.gdn_per_period)

  @property
  def block_kinds(self) -> tuple[str, ...]:
    return self.period_kinds * self.num_periods

  def replace(self, **changes) -> "ModelConfig":
    """Changes decoder fields, or layer fields (`hidden_size`, `num_k_heads`, ...)."""
    layer_fields = {f.name for f in dataclasses.fields(GatedDeltaNetConfig)}
    gdn_changes = {k: changes.pop(k) for k in list(changes) if k in layer_fields}
    if gdn_changes:
      changes["gdn"] = dataclasses.replace(changes.get("gdn", self.gdn), **gdn_changes)
    return dataclasses.replace(self, **changes)

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
    """From a preset's parsed yml (layer fields + a `model:` section)."""
    d = dict(d)
    section = d.pop(MODEL_SECTION, None)
    name = d.get("name", "")
    if not isinstance(section, dict):
      raise ValueError(
          f"Model preset {name or '(unnamed)'!r} has no `{MODEL_SECTION}:` section with the"
          " decoder's shapes (num_layers, num_experts, ...); only its GatedDeltaNet layer"
          " is described.")
    names = {f.name for f in dataclasses.fields(cls)} - {"gdn", "name"}
    unknown = set(section) - names
    if unknown:
      raise ValueError(f"Unknown `{MODEL_SECTION}:` keys {sorted(unknown)}; valid: {sorted(names)}.")
    missing = [f.name for f in dataclasses.fields(cls) if f.name in names
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
               and f.name not in section]
    if missing:
      raise ValueError(f"`{MODEL_SECTION}:` fields {missing} are missing.")
    return cls(gdn=GatedDeltaNetConfig.from_dict(d), name=name, **section)

  @classmethod
  def load(cls, spec: str, **overrides) -> "ModelConfig":
    """A preset name (`qwen3.5-micro`) or a path to a preset .yml; `overrides`
    as in `replace`."""
    cfg = presets.read_preset(presets.preset_file(spec), cls.from_dict)
    return cfg.replace(**overrides) if overrides else cfg
