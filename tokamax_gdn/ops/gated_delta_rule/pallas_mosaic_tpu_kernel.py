"""The Pallas Mosaic TPU kernels of the chunked gated delta rule, by name.

The kernels live in one module per concept (`docs/gdn_pallas_tpu.md` is their
design, `docs/gdn_math.md` their algebra):

- `pallas_mosaic_tpu_gates`: per-token gate stages (cumsum, Γ, decays);
- `pallas_mosaic_tpu_inverse`: the triangular inverse T';
- `pallas_mosaic_tpu_common`: static config, named refs, head layout;
- `pallas_mosaic_tpu_prologue`: the op's prologue in the kernels and its VJPs;
- `pallas_mosaic_tpu_guard`: the NaN guard;
- `pallas_mosaic_tpu_fwd_kernel` / `_bwd_kernel`: the kernels;
- `pallas_mosaic_tpu_call`: host wrappers `gdn_fwd`, `gdn_bwd`;
- `pallas_mosaic_tpu_requests`: the serving op's request-packed forward;
- `ops/numerics.py`: the bf16 / MXU precision helpers.

This module re-exports their public entry points under the names callers used.
"""

# pylint: disable=g-importing-member,unused-import
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_call import gdn_bwd
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_call import gdn_fwd
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_common import default_newton
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_common import normalize_interleave
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_common import v5e_forms
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_gates import chunk_cumsum
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_gates import chunk_gate
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_gates import ChunkGate
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_gates import gamma_decay_in
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_gates import lane_rowsums
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_gates import rowsum_row
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_inverse import invert_unit_lower
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_prologue import Prologue
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_requests import gdn_fwd_requests
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_requests import num_items
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_requests import PackedRequests
from tokamax_gdn.ops.numerics import lhs_masked
from tokamax_gdn.ops.numerics import mxu
from tokamax_gdn.ops.numerics import round_bf16
from tokamax_gdn.ops.numerics import rounded_bf16
from tokamax_gdn.ops.numerics import split
from tokamax_gdn.ops.numerics import split_bf16
from tokamax_gdn.ops.numerics import stacked_bf16
