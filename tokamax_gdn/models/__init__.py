"""A small Qwen3.5-style hybrid decoder (GatedDeltaNet + softmax attention
blocks, routed MoE MLPs on gmm) as pure functions on param dicts, and greedy
generation with state pools (`generate`, in `models/generation.py`: the module
is not named after the function, so `tokamax_gdn.models.generate` is the
function and never the module)."""

from tokamax_gdn.models.blocks import attention, moe, rms_norm  # pylint: disable=g-multiple-import
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.models.decoder import block, forward, init_block, init_params  # pylint: disable=g-multiple-import
from tokamax_gdn.models.generation import GenerationCache, generate, init_cache, step  # pylint: disable=g-multiple-import

__all__ = ["GenerationCache", "ModelConfig", "attention", "block", "forward", "generate",
           "init_block", "init_cache", "init_params", "moe", "rms_norm", "step"]
