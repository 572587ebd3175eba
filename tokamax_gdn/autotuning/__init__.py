"""Autotuning foundations every op imports: named workloads and the shipped cache.

- `arg_spec`: `ArgSpec`, the named workloads each op declares in its
  `arg_specs.py` (`registry.arg_specs(op, tag)` reads them).
- `cache`: results shipped inside this package, read like tokamax's own cache
  (`ShippedAutotuningCacheMixin` on every Op; `install`, `reload`, `lookup`).

Nothing here imports an op or the registry (tests/imports_test.py): the tuning
run that does is `tokamax_gdn.benchmarks.autotune` (`tokamax-gdn autotune`).
"""

from tokamax_gdn.autotuning.arg_spec import ArgSpec  # pylint: disable=g-importing-member
from tokamax_gdn.autotuning.cache import (  # pylint: disable=g-importing-member,g-multiple-import
    CACHE_PATH,
    ENV_DIRS,
    ShippedAutotuningCacheMixin,
    cache_file_contents,
    install,
    load_shipped,
    lookup,
    normalize_device_kind,
    op_file_name,
    package_dir,
    reload,
    shipped_files,
)

__all__ = [
    "ArgSpec",
    "CACHE_PATH", "ENV_DIRS", "ShippedAutotuningCacheMixin", "load_shipped", "install",
    "reload", "cache_file_contents", "shipped_files", "package_dir", "op_file_name",
    "normalize_device_kind", "lookup",
]
