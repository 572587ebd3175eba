"""Ahead-of-time compiles for real TPU generations on a CPU-only machine.

- `compiler`: compile one function for a target chip through libtpu, read the
  memory sizes and the static cycle estimate, compile in a child process,
  calibrate the rooflines (re-exported here: `tokamax_gdn.aot.compile_for`, ...).
- `gated_delta_rule`: the GDN layer call's per-pass report (`tokamax-gdn aot`).
- `serving`: the serving op's report (`tokamax-gdn aot --op causal_conv1d_gated_delta_rule`).
- `training`: one whole training step for a TPU slice (`tokamax-gdn aot --train-step`).
"""

from tokamax_gdn.aot.compiler import bundle_units
from tokamax_gdn.aot.compiler import calibrate
from tokamax_gdn.aot.compiler import calibration_cases
from tokamax_gdn.aot.compiler import Case
from tokamax_gdn.aot.compiler import ChildResult
from tokamax_gdn.aot.compiler import clear_cycle_dumps
from tokamax_gdn.aot.compiler import compile_cases
from tokamax_gdn.aot.compiler import compile_for
from tokamax_gdn.aot.compiler import compile_in_child
from tokamax_gdn.aot.compiler import CompileReport
from tokamax_gdn.aot.compiler import copies
from tokamax_gdn.aot.compiler import copy
from tokamax_gdn.aot.compiler import dense_matmul
from tokamax_gdn.aot.compiler import enable_cycle_estimates
from tokamax_gdn.aot.compiler import kernel_name
from tokamax_gdn.aot.compiler import on_target
from tokamax_gdn.aot.compiler import pallas_calls
from tokamax_gdn.aot.compiler import roofline_cycles
from tokamax_gdn.aot.compiler import spec
from tokamax_gdn.aot.compiler import target_mesh
