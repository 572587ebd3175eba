"""Causal depthwise conv1d (fused SiLU): reference, XLA and Pallas TPU."""

from tokamax_gdn.ops.causal_conv1d.api import causal_conv1d

__all__ = ["causal_conv1d"]
