"""Context parallelism: T sharded over a mesh axis gives the unsharded results.

The checks live in `context_parallel_checks.py` (its docstring says what each
problem contains). Each runs in its own subprocess with 8 host CPU devices
(as `sharding_test.py` runs its own), so that pytest-xdist spreads them over
its workers: some take minutes on a small machine (Pallas interpret mode).
"""

import importlib.util
import pathlib

import pytest

from tests import sharding_test

SCRIPT = pathlib.Path(__file__).resolve().parent / "context_parallel_checks.py"
_spec = importlib.util.spec_from_file_location("context_parallel_checks", SCRIPT)
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


def _names(group):
  return [n for n, (g, _) in checks.CHECKS.items() if g == group]


def _check(group, name, tmp_path_factory, host_devices=None):
  # pylint: disable-next=protected-access
  results = sharding_test._run(group, tmp_path_factory, script=SCRIPT,
                               host_devices=host_devices, timeout=1800, names=(name,))
  sharding_test._assert(results, name)  # pylint: disable=protected-access


@pytest.mark.parametrize("name", _names("cp"))
def test_context_parallel_matches_unsharded(name, tmp_path_factory):
  _check("cp", name, tmp_path_factory, host_devices=8)
