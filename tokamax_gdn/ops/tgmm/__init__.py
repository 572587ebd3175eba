"""Transposed grouped matmul: out[g] = lhs[rows_g]^T @ rhs[rows_g] (gmm's weight gradient).

Layers: `api.py` (tgmm), `base.py` (the Op and its checks), one module per
implementation (`pallas_mosaic_tpu.py`, `xla.py`, `reference.py`). The Pallas
kernel lives with gmm's, which it shares a schedule with:
`tokamax_gdn/ops/gmm/pallas_mosaic_tpu_kernel.py` (`tgmm`).
"""
