"""`tokamax-gdn aot --train-step` refuses bad arguments with a clear message.

The compile itself (a whole qwen3.5-tiny training step with the Pallas
kernels for a tpu7x 2x2 mesh: Mosaic kernels, memory per device, the
params' sharding) is `tests/integrations/maxtext_aot_test.py`'s. (A toy-width
copy of that compile ran here too, 19 s of the CI budget for nothing the
qwen3.5-tiny one does not check.)"""

import os

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # other processes may hold libtpu

import re  # pylint: disable=g-import-not-at-top

import pytest  # pylint: disable=g-import-not-at-top

from tokamax_gdn import cli  # pylint: disable=g-import-not-at-top


@pytest.mark.parametrize("argv, match", [
    (["aot", "--train-step", "--model", "qwen3.5-tiny", "--mesh", "2by4"], "expected DATAxMODEL"),
    (["aot", "--train-step"], "needs --model"),
])
def test_train_step_command_rejects_bad_arguments(argv, match, capsys):
  assert cli.main(argv) == 2
  assert re.search(match, capsys.readouterr().err)
