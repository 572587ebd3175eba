"""Model FLOPs of one training step, for MFU.

MFU = model FLOPs per step / (step time x the chip's peak FLOP/s). Model
FLOPs are what the model needs, not what an implementation executes (no
recomputation under remat, no masked-out attention scores, no padding), so
two implementations of the same step are compared on one count:

  matmul     6 · N_active · tokens: every weight matrix a token multiplies
             (2 FLOPs per weight forward, 4 backward: input and weight
             gradients). N_active counts the GDN in/out projections, the
             attention q/k/v/o projections, the router, the MoE experts a
             token is routed to (top-k of them, each gate, up and down) and
             the LM head (tied or not, it is a matmul). The embedding lookup
             is a gather: not counted.
  attention  per attention layer, causal: scores Q Kᵀ and weighted values
             P V over the lower triangle, 2 · 2 · B · T² / 2 · H · D forward
             (so 2 B T² H D), 3x that for forward+backward. The model's
             attention computes the full T x T square and masks it: it
             executes twice this.
  gdn        per GDN layer: the chunked gated delta rule's essential matmul
             FLOPs at chunk 64 (`benchmarks.workload.essential_flops`, the
             count `tokamax-gdn bench` reports MFU with) plus the depthwise
             causal conv (2 · width FLOPs per channel per token), 3x
             forward for forward+backward.

Norms, gates, softmax exponentials, the router's top-k and the optimizer
update are elementwise work, left out as MFU conventions do (PaLM, MaxText).
"""

import dataclasses

from tokamax_gdn.benchmarks import workload
from tokamax_gdn.models.config import ModelConfig

# The chunk the GDN layer's essential FLOPs are counted at (as in the
# benchmarks' MFU): the count grows with the chunk, so it is fixed here, not
# taken from whichever config an implementation picked.
GDN_FLOPS_CHUNK = workload.FLOPS_CHUNK
# Forward + backward = 3x forward for every matmul-like op.
TRAIN_FACTOR = 3


@dataclasses.dataclass(frozen=True)
class StepFlops:
  """FLOPs of one training step (forward + backward), by kind (module docstring)."""

  matmul: float
  attention: float
  gdn: float

  @property
  def total(self) -> float:
    return self.matmul + self.attention + self.gdn


def active_matmul_params(cfg: ModelConfig) -> int:
  """Weights one token multiplies in a forward pass (the N of 6 · N · tokens)."""
  g = cfg.gdn
  hidden = cfg.hidden_size
  gdn_block = hidden * g.in_proj_dim + g.value_dim * hidden
  heads, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
  attention_block = hidden * heads * d + 2 * hidden * kv * d + heads * d * hidden
  moe = hidden * cfg.num_experts + cfg.num_experts_per_tok * 3 * hidden * cfg.moe_intermediate_size
  kinds = cfg.block_kinds
  n_gdn, n_attention = kinds.count("gdn"), kinds.count("attention")
  return (n_gdn * gdn_block + n_attention * attention_block + cfg.num_layers * moe
          + hidden * cfg.vocab_size)


def step_flops(cfg: ModelConfig, batch: int, seq_len: int) -> StepFlops:
  """Model FLOPs of one training step on `batch` sequences of `seq_len` tokens."""
  tokens = batch * seq_len
  kinds = cfg.block_kinds
  n_gdn, n_attention = kinds.count("gdn"), kinds.count("attention")
  attention_fwd = 2 * batch * seq_len**2 * cfg.num_attention_heads * cfg.head_dim
  g = cfg.gdn
  shape = workload.LayerShape(b=batch, t=seq_len, hk=g.num_k_heads, hv=g.num_v_heads,
                              k=g.head_k_dim, v=g.head_v_dim)
  conv_fwd = 2 * g.conv_kernel_size * g.conv_dim * tokens
  gdn_layer = (workload.essential_flops(shape, GDN_FLOPS_CHUNK, backward=True)
               + TRAIN_FACTOR * conv_fwd)
  return StepFlops(matmul=float(2 * TRAIN_FACTOR * active_matmul_params(cfg) * tokens),
                   attention=float(n_attention * TRAIN_FACTOR * attention_fwd),
                   gdn=float(n_gdn * gdn_layer))


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
  """flops / seconds as a fraction of `peak_flops` (None when the peak is unknown)."""
  if not peak_flops or not seconds:
    return None
  return flops / seconds / peak_flops
