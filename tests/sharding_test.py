"""Sharded GDN / causal_conv1d / gmm give the unsharded results, and sharded
GDN forward+backward compiles for tpu7x 2x2x1 (8 TensorCores).

The checks live in `multidevice/sharding_checks.py` and run in subprocesses
(`multidevice.runner`): the CPU ones need 8 host devices, which the other
tests must not get.
"""

import pytest

from tests.multidevice import runner

SCRIPT = runner.HERE / "sharding_checks.py"


def test_sharded_matches_unsharded(tmp_path_factory):
  runner.check_group("cpu", tmp_path_factory, SCRIPT)


@pytest.mark.aot
def test_aot_tpu7x_8_devices(tmp_path_factory):
  runner.check_group("aot", tmp_path_factory, SCRIPT)
