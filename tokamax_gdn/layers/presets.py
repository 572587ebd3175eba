"""Model presets: `configs/models/<name>.yml` as `GatedDeltaNetConfig`s.

Looked up in `$TOKAMAX_GDN_MODELS_DIR`, then the repository's `configs/models/`
(editable installs), then `tokamax_gdn/data/models/` (wheels).
"""

import dataclasses
import os
import pathlib

from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig

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
  an unknown name.
  """
  path = pathlib.Path(spec)
  if path.is_file():
    return path
  name = path.stem if path.suffix in (".yml", ".yaml") else str(spec)
  for d in _dirs():
    p = d / f"{name}.yml"
    if p.is_file():
      return p
  raise ValueError(f"Unknown model preset {name!r}; available: {', '.join(list_presets())}.")


def load_preset(spec: str | os.PathLike[str], **overrides) -> GatedDeltaNetConfig:
  """`load_preset("qwen3.5-tiny")` (a name or a .yml path, see `preset_file`);
  keyword overrides replace fields."""
  cfg = GatedDeltaNetConfig.from_yaml(preset_file(spec))
  if overrides:
    cfg = dataclasses.replace(cfg, **overrides)
  return cfg
