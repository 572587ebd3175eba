"""Model presets: finding and reading `configs/models/<name>.yml` (the layer
builds its `GatedDeltaNetConfig` from them: `gated_deltanet.load_preset`).

Looked up in `$TOKAMAX_GDN_MODELS_DIR`, then the repository's `configs/models/`
(editable installs), then `tokamax_gdn/data/models/` (wheels).
"""

import os
import pathlib
from typing import Any, Callable

import yaml


_PKG = pathlib.Path(__file__).resolve().parent.parent


def _dirs() -> list[pathlib.Path]:
  dirs = []
  if env := os.environ.get("TOKAMAX_GDN_MODELS_DIR"):
    dirs.append(pathlib.Path(env))
  dirs += [_PKG.parent / "configs" / "models", _PKG / "data" / "models"]
  return [d for d in dirs if d.is_dir()]


def list_presets() -> list[str]:
  """Names of the presets found, sorted."""
  return sorted({p.stem for d in _dirs() for p in d.glob("*.yml")})


def preset_file(spec: str | os.PathLike[str]) -> pathlib.Path:
  """The .yml of a preset name (`qwen3.5-tiny`) or of a path to a preset .yml.

  A path that is not a file but looks like one (`configs/models/<name>.yml`
  outside a checkout) names the preset shipped in the package. ValueError for
  an unknown name, or for a missing file that names no shipped preset.
  """
  path = pathlib.Path(spec)
  if path.is_file():
    return path
  looks_like_a_path = path.suffix in (".yml", ".yaml") or len(path.parts) > 1
  name = path.stem if looks_like_a_path else str(spec)
  for d in _dirs():
    p = d / f"{name}.yml"
    if p.is_file():
      return p
  if looks_like_a_path:
    raise ValueError(f"model preset file {str(path)!r} does not exist (nor is {name!r} a"
                     " shipped preset).")
  raise ValueError(f"Unknown model preset {name!r}; available: {', '.join(list_presets())}.")


def read_preset(path, build: Callable[[dict[str, Any]], Any]):
  """build(the mapping in preset file `path`); every problem (a missing file,
  invalid YAML, not a mapping, missing or unknown fields) is a one-line
  ValueError naming the file."""
  path = pathlib.Path(path)
  if not path.is_file():
    raise ValueError(f"model preset file {str(path)!r} does not exist.")
  try:
    d = yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    problem = " ".join(str(e).split())
    raise ValueError(f"{path}: not valid YAML: {problem}") from None
  if not isinstance(d, dict):
    raise ValueError(f"{path}: expected a mapping of config fields (`hidden_size: 128`, ...),"
                     f" got {type(d).__name__}.")
  try:
    return build(d)
  except (TypeError, ValueError) as e:
    raise ValueError(f"{path}: {e}") from None
