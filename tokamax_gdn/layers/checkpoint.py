"""Loading one GatedDeltaNet layer from a Hugging Face safetensors checkpoint.

Needs the `safetensors` package (`pip install safetensors`; not a dependency
of tokamax_gdn itself). Only the tensors of the requested layer are read: a
safetensors file is memory-mapped and read per tensor, so loading one layer of
an 80B checkpoint touches that layer's bytes only.
"""

import json
import os

from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig, Params, params_from_hf

INDEX = "model.safetensors.index.json"   # HF's map from tensor name to shard file
SINGLE = "model.safetensors"             # HF's name for an unsharded checkpoint


def _files_holding(path: str, prefix: str) -> list[str]:
  """The safetensors files under `path` that may hold keys starting with `prefix`."""
  if not os.path.isdir(path):
    return [path]
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted({fn for k, fn in weight_map.items() if k.startswith(prefix)})
    if not files:
      raise ValueError(f"{index} names no tensor starting with prefix={prefix!r}.")
    return [os.path.join(path, fn) for fn in files]
  if os.path.exists(os.path.join(path, SINGLE)):
    return [os.path.join(path, SINGLE)]
  raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE}.")


def load_hf_layer(path: str, cfg: GatedDeltaNetConfig, *, prefix: str,
                  dtype=None) -> Params:
  """Params of the `linear_attn` layer whose tensors start with `prefix`.

  Args:
    path: a `.safetensors` file, or an HF checkpoint directory (sharded, with
      `model.safetensors.index.json`, or a single `model.safetensors`).
    cfg: the layer's config (e.g. `GatedDeltaNetConfig.from_hf_config` of the
      checkpoint's `config.json`).
    prefix: the layer's key prefix as the checkpoint's index spells it, e.g.
      `"model.layers.0.linear_attn."` (Qwen3-Next).
    dtype: as in `params_from_hf`.

  Raises what `params_from_hf` raises (unknown or missing names, shapes), and
  ValueError when no tensor starts with `prefix`.
  """
  try:
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("load_hf_layer reads safetensors files: pip install safetensors") from e
  tensors = {}
  for fn in _files_holding(path, prefix):
    with safe_open(fn, framework="numpy") as f:
      for k in f.keys():
        if k.startswith(prefix):
          tensors[k] = f.get_tensor(k)
  return params_from_hf(tensors, cfg, dtype, prefix=prefix)
