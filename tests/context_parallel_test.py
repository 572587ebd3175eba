"""Context parallelism: T sharded over a mesh axis gives the unsharded results.

The checks live in `context_parallel_checks.py` (its docstring says what each
problem contains) and run in one subprocess with 8 host CPU devices, as
`sharding_test.py` runs its own (see `sharding_test.check_group` for why one
test per group). The AOT check compiles CP Pallas GDN fwd+bwd for tpu7x.
"""

import pathlib

import pytest

from tests import sharding_test

SCRIPT = pathlib.Path(__file__).resolve().parent / "context_parallel_checks.py"


def test_context_parallel_matches_unsharded(tmp_path_factory):
  sharding_test.check_group("cp", tmp_path_factory, script=SCRIPT, host_devices=8,
                            timeout=1800)


@pytest.mark.aot
def test_context_parallel_aot_tpu7x(tmp_path_factory):
  sharding_test.check_group("cp_aot", tmp_path_factory, script=SCRIPT)
