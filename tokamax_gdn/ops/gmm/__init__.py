"""Grouped matmul: out[rows of group g] = lhs[rows] @ rhs[g] (as `jax.lax.ragged_dot`).

Layers: `api.py` (gmm), `base.py` (the Op, its checks, and what tgmm's Op
shares), one module per implementation (`pallas_mosaic_tpu.py`, `xla.py`,
`reference.py`) and the Pallas kernels of gmm and tgmm with their one
schedule (`pallas_mosaic_tpu_kernel.py`).
"""
