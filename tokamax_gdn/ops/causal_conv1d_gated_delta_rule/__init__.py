"""Serving GDN: causal conv1d + gated delta rule on state pools (tokamax's calling convention)."""

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.api import causal_conv1d_gated_delta_rule

__all__ = ["causal_conv1d_gated_delta_rule"]
