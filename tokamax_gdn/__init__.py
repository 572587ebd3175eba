"""tokamax_gdn: Gated Delta Net, causal conv1d, grouped matmuls and the gated RMSNorm for tokamax."""

import os as _os

# No TPU metadata-server lookups from libtpu on machines without a TPU.
_os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

from tokamax_gdn import config

config.skip_tpu_backend_without_chips()

from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d.api import causal_conv1d
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.api import causal_conv1d_gated_delta_rule
from tokamax_gdn.ops.gated_delta_rule.api import gated_delta_rule
from tokamax_gdn.ops.gated_delta_rule.fla import chunk_gated_delta_rule
from tokamax_gdn.ops.gated_rmsnorm.api import gated_rmsnorm
from tokamax_gdn.ops.gmm.api import gmm
from tokamax_gdn.ops.tgmm.api import tgmm
from tokamax_gdn import layers

__all__ = [
    "config", "registry", "layers",
    "gated_delta_rule", "chunk_gated_delta_rule", "causal_conv1d", "gmm", "tgmm",
    "causal_conv1d_gated_delta_rule", "gated_rmsnorm",
]
