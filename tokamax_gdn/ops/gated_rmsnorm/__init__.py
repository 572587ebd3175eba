"""Gated RMSNorm (the GatedDeltaNet layer's output norm): reference, XLA and Pallas TPU."""

from tokamax_gdn.ops.gated_rmsnorm.api import gated_rmsnorm

__all__ = ["gated_rmsnorm"]
