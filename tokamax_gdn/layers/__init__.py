"""Layers built on the ops: the Qwen3-Next / Qwen3.5 GatedDeltaNet block."""

from tokamax_gdn.layers.gated_deltanet import (  # pylint: disable=g-multiple-import
    GatedDeltaNetCache,
    GatedDeltaNetConfig,
    gated_deltanet,
    gated_rmsnorm,
    init_params,
    param_shapes,
    params_from_hf,
    params_to_hf,
)
from tokamax_gdn.layers.checkpoint import load_hf_layer
from tokamax_gdn.layers.presets import list_presets, load_preset

__all__ = [
    "GatedDeltaNetCache", "GatedDeltaNetConfig", "gated_deltanet", "gated_rmsnorm",
    "init_params", "param_shapes", "params_from_hf", "params_to_hf",
    "load_hf_layer", "list_presets", "load_preset",
]
