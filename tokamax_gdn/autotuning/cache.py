"""Autotuning results shipped inside this package, read like tokamax's own.

tokamax looks configs up in `tokamax/data/autotuning/<device_kind>/<op>.json`,
inside its own package, where a plugin cannot add files. Ops of this package
mix in `ShippedAutotuningCacheMixin`, which also reads
`tokamax_gdn/data/autotuning/<device_kind>/<op>.json` (same layout, same file
format, same `<op>` name: the snake_case Op class name, which names the
implementation, e.g. `xla_gated_delta_rule.json`, `xla_gated_delta_rule_vjp.json`)
and merges it *under* tokamax's cache: an entry tokamax has, or one autotuned in
this process, wins. On a miss tokamax's `autotuning_cache_miss_fallback` applies
unchanged (heuristics by default).

`install(result)` writes a `tokamax.AutotuningResult` (from `tokamax.autotune`,
or `AutotuningResult.loads` of its `dumps()`) into those files.
"""

from collections.abc import Iterable, Mapping
import importlib.resources
import logging as std_logging
import os
import pathlib
from typing import Any

from absl import logging
from jax.extend import backend
from tokamax._src import config as tokamax_config
from tokamax._src.autotuning import api as autotuning_api
from tokamax._src.autotuning import autotuner
from tokamax._src.autotuning import cache as cache_lib
from tokamax._src.ops import op as op_lib

CACHE_PATH = "data/autotuning"
# Extra directories (same `<device_kind>/<op>.json` layout) read after the
# shipped data, later ones winning: `os.pathsep`-separated.
ENV_DIRS = "TOKAMAX_GDN_AUTOTUNING_DIRS"

# (op without vjp, device kind) -> the tokamax cache dict already merged into.
_merged: dict[tuple[op_lib.Op, str], dict] = {}


def normalize_device_kind(device_kind: str) -> str:
  """The directory name tokamax uses for a `device.device_kind`."""
  return device_kind.lower().replace(" ", "_")


def op_file_name(op: op_lib.Op | type[op_lib.Op]) -> str:
  """`XlaGatedDeltaRuleVjp` -> `xla_gated_delta_rule_vjp.json` (tokamax's rule)."""
  return f"{op_lib.snake_case_name(op)}.json"


def package_dir() -> pathlib.Path:
  """`tokamax_gdn/data/autotuning` of the imported package (where `install` writes)."""
  return pathlib.Path(__file__).resolve().parent.parent / CACHE_PATH


def _sources(device_kind: str, file_name: str) -> list[Any]:
  kind = normalize_device_kind(device_kind)
  paths: list[Any] = [
      importlib.resources.files("tokamax_gdn").joinpath(CACHE_PATH, kind, file_name)
  ]
  for d in filter(None, os.environ.get(ENV_DIRS, "").split(os.pathsep)):
    paths.append(pathlib.Path(d) / kind / file_name)
  return paths


def load_shipped(op: op_lib.Op, device_kind: str) -> dict[Any, autotuner.AutotuningData]:
  """Autotuning cache key -> data, from the package (and `$TOKAMAX_GDN_AUTOTUNING_DIRS`)."""
  op = op.replace(vjp=None)
  out = {}
  for path in _sources(device_kind, op_file_name(op)):
    try:
      text = path.read_text()
    except (FileNotFoundError, NotADirectoryError):
      continue
    try:
      data = cache_lib._get_cache_adapter(op).validate_json(text)  # pylint: disable=protected-access
      out |= {op.bind(**k).autotuning_cache_key: v for k, v in data.items()}
    except Exception:  # pylint: disable=broad-except
      # A stale file (e.g. an argument renamed since) must not break the op.
      logging.exception("Skipping unreadable autotuning file %s", path)
  return out


class ShippedAutotuningCacheMixin:
  """Put first in an `Op`'s bases: its cache also holds this package's data."""

  def get_autotuning_cache(self, device_kind: str | None = None):
    cache = super().get_autotuning_cache(device_kind)  # pytype: disable=attribute-error
    if tokamax_config.ignore_autotuning_cache.value:
      return cache
    if device_kind is None:
      device_kind = backend.get_default_device().device_kind
    key = (self.replace(vjp=None), device_kind)  # pytype: disable=attribute-error
    # tokamax keeps one dict per (op, device kind) and adds results autotuned
    # in-process to it: merge into that dict once, never over its entries.
    if _merged.get(key) is not cache:
      for k, v in load_shipped(key[0], device_kind).items():
        cache.setdefault(k, v)
      _merged[key] = cache
    return cache


# tokamax logs a WARNING with the Op and its whole cache key for every shape it
# has no tuned config for. For a plugin's ops that is the normal path (the
# heuristics choose the config), so for ours it becomes one DEBUG line here.
_CACHE_MISS = "Autotuning cache miss for %s on %s with key %s"
_logger = std_logging.getLogger(__name__)


class _OurCacheMissesAtDebug(std_logging.Filter):

  def filter(self, record: std_logging.LogRecord) -> bool:
    args = record.args if isinstance(record.args, tuple) else ()
    if record.msg == _CACHE_MISS and args and isinstance(args[0], ShippedAutotuningCacheMixin):
      _logger.debug("autotuning cache miss for %s on %s: heuristics config",
                    type(args[0]).__name__, args[1])
      return False
    return True


_absl_logger = std_logging.getLogger("absl")  # tokamax logs through absl.logging
if not any(isinstance(f, _OurCacheMissesAtDebug) for f in _absl_logger.filters):
  _absl_logger.addFilter(_OurCacheMissesAtDebug())


def reload() -> None:
  """Forgets loaded caches (tokamax's too) for our ops, so files are re-read."""
  for op in {k[0] for k in _merged}:
    op_lib._AUTOTUNING_CACHE.pop(op, None)  # pylint: disable=protected-access
  _merged.clear()


def _group(result: autotuning_api.AutotuningResult) -> dict[op_lib.Op, dict]:
  """Op (no config, no vjp) -> {arguments: data}, errors pruned."""
  groups: dict[op_lib.Op, dict] = {}
  for ba, data in result.data:
    op = ba.op.replace(config=None, vjp=None)
    pruned = data.prune_errors()
    if pruned:
      groups.setdefault(op, {})[ba.arguments] = autotuner.AutotuningData(pruned)
  return groups


def cache_file_contents(
    result: autotuning_api.AutotuningResult,
) -> dict[str, str]:
  """`<op>.json` file name -> JSON text in tokamax's cache-file format."""
  out = {}
  for op, entries in _group(result).items():
    adapter = cache_lib._get_cache_adapter(op)  # pylint: disable=protected-access
    out[op_file_name(op)] = str(adapter.dump_json(entries, indent=2, round_trip=True), "utf-8")
  return out


def install(
    result: autotuning_api.AutotuningResult,
    root: str | os.PathLike[str] | None = None,
    *,
    merge: bool = True,
) -> list[pathlib.Path]:
  """Writes `result` under `root/<device_kind>/<op>.json` (default: the package).

  With `merge`, entries already in a file are kept unless `result` has the same
  arguments, whose configs then replace theirs. Returns the files written.
  """
  root = pathlib.Path(root) if root is not None else package_dir()
  out_dir = root / normalize_device_kind(result.device_kind)
  written = []
  for op, entries in _group(result).items():
    path = out_dir / op_file_name(op)
    adapter = cache_lib._get_cache_adapter(op)  # pylint: disable=protected-access
    merged: dict = {}
    if merge and path.is_file():
      try:
        old = adapter.validate_json(path.read_text())
      except Exception:  # pylint: disable=broad-except
        logging.exception("Replacing unreadable autotuning file %s", path)
      else:
        keys = {op.bind(**k).autotuning_cache_key: k for k in old}
        merged = {k: old[k] for k in old}
        for args in entries:
          stale = keys.get(op.bind(**args).autotuning_cache_key)
          if stale is not None:
            merged.pop(stale, None)
    merged.update(entries)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(str(adapter.dump_json(merged, indent=2, round_trip=True), "utf-8") + "\n")
    written.append(path)
  reload()
  return written


def shipped_files(device_kind: str | None = None) -> list[pathlib.Path]:
  """The shipped `<device_kind>/<op>.json` files (all device kinds by default)."""
  root = package_dir()
  pattern = f"{normalize_device_kind(device_kind)}/*.json" if device_kind else "*/*.json"
  return sorted(root.glob(pattern))


def lookup(
    op: op_lib.Op, args: Iterable[Any], kwargs: Mapping[str, Any], device_kind: str | None = None
) -> autotuner.AutotuningData | None:
  """The cached autotuning data for `op(*args, **kwargs)` (shipped or tokamax's)."""
  ba = op.bind(*args, **kwargs)
  if device_kind is None:
    return ba.cached_autotuning_data
  return op.get_autotuning_cache(device_kind).get(ba.autotuning_cache_key)

