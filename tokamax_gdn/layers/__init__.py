"""Layers built on the ops: the Qwen3-Next / Qwen3.5 GatedDeltaNet block."""

from tokamax_gdn.layers.gated_deltanet import (  # pylint: disable=g-multiple-import
    GatedDeltaNetCache,
    GatedDeltaNetConfig,
    gated_deltanet,
    gated_rmsnorm,
    load_preset,
    init_params,
    param_shapes,
)
from tokamax_gdn.layers.hf import HF_NAMES, load_hf_layer, params_from_hf, params_to_hf  # pylint: disable=g-multiple-import
from tokamax_gdn.layers.presets import list_presets

__all__ = [
    "GatedDeltaNetCache", "GatedDeltaNetConfig", "gated_deltanet", "gated_rmsnorm",
    "init_params", "param_shapes", "params_from_hf", "params_to_hf",
    "HF_NAMES", "load_hf_layer", "list_presets", "load_preset",
]
