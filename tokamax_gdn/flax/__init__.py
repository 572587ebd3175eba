"""Flax NNX modules for the GatedDeltaNet layer and the decoder's blocks
(optional: `pip install 'tokamax_gdn[flax]'`)."""

try:
  from flax import nnx  # pylint: disable=unused-import
except ImportError as e:  # pragma: no cover - depends on the install
  raise ImportError("tokamax_gdn.flax needs flax: pip install 'tokamax_gdn[flax]'.") from e

from tokamax_gdn.flax.modules import Attention, DecoderBlock, GatedDeltaNet, MoE  # pylint: disable=g-multiple-import

__all__ = ["Attention", "DecoderBlock", "GatedDeltaNet", "MoE"]
