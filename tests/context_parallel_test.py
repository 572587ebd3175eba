"""Context parallelism: T sharded over a mesh axis gives the unsharded results.

The checks live in `multidevice/context_parallel_checks.py` (its docstring
says what each problem contains) and run in one subprocess with 8 host CPU
devices (see `multidevice.runner.check_group` for why one test per group).
The AOT check compiles CP Pallas GDN fwd+bwd for tpu7x.
"""

import pytest

from tests.multidevice import runner

SCRIPT = runner.HERE / "context_parallel_checks.py"


def test_context_parallel_matches_unsharded(tmp_path_factory):
  runner.check_group("cp", tmp_path_factory, SCRIPT, host_devices=8, timeout=1800)


@pytest.mark.aot
def test_context_parallel_aot_tpu7x(tmp_path_factory):
  runner.check_group("cp_aot", tmp_path_factory, SCRIPT)
