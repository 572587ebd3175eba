"""Context parallelism: T sharded over a mesh axis gives the unsharded results.

The checks live in `context_parallel_checks.py` (its docstring says what each
problem contains) and run in one subprocess with 8 host CPU devices, as
`sharding_test.py` runs its own.
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


@pytest.fixture(scope="module")
def cp_results(tmp_path_factory):
  # pylint: disable-next=protected-access
  return sharding_test._run("cp", tmp_path_factory, script=SCRIPT, host_devices=8,
                            timeout=1800)


@pytest.mark.parametrize("name", _names("cp"))
def test_context_parallel_matches_unsharded(cp_results, name):
  sharding_test._assert(cp_results, name)  # pylint: disable=protected-access
