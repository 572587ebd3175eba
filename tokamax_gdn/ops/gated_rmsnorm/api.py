"""`gated_rmsnorm`: the user-facing function."""

from collections.abc import Sequence

import jax

from tokamax_gdn import registry


def gated_rmsnorm(
    x: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    *,
    eps: float = 1e-6,
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
  """Gated RMSNorm over the last axis, as Qwen3-Next / Qwen3.5's GatedDeltaNet
  output norm (HF `Qwen3NextRMSNormGated`, to the cast):

    y = weight · (x / sqrt(mean(x²) + eps)) · silu(gate)

  normalised in float32 and cast to x's dtype before the weight, multiplied
  by silu(gate) in float32 (`base.py` has the exact casts and the backward).

  Args:
    x: [..., D], normalised over D (e.g. [B, T, Hv, V]: per value head).
    gate: [..., D], same shape (the layer's z).
    weight: [D].
    eps: added to the mean square.
    implementation: None (best available), a name from
      `tokamax_gdn.registry.implementations("gated_rmsnorm")`, a
      `tokamax.Op`, or a sequence of those tried in order.

  Returns:
    y [..., D] in x's dtype. Differentiable in reverse mode (x, gate, weight).
  """
  return registry.call("gated_rmsnorm", implementation, x, gate, weight, eps=eps)
