"""The VMEM model of the Pallas GDN kernels: what one grid step needs.

`vmem_estimate` is the scoped VMEM of one kernel's grid step (its scratch
exactly, plus a fit of what Mosaic allocates itself); `vmem_cap` is the
scoped limit the kernels get on a TPU generation. The op wrapper picks
configs that fit. The fit's measured points are in docs/gdn_pallas_tpu.md, "VMEM model".
The serving op's request-packed forward has a model of its own,
`requests_vmem_estimate` (its measured points: the serving op's
`pallas_mosaic_tpu_test._REQUESTS_VMEM_V5E`).
"""

from typing import Literal

import jax

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kernel_prologue
from tokamax_gdn.ops.tiling import round_up

_MIB = 1 << 20


# What the backward's scoped VMEM grows by past T = _LONG_BWD_FROM (see
# `vmem_estimate`), per 16 value heads (at least once): 1.07 MiB measured up
# to T = 131072 at 16 heads a device (tpu7x), with a quarter MiB to spare;
# at 64 value heads on v5e (C = 128) 2 MiB more from T = 8192 to 32768, and
# 55.0 MiB at T = 32768 with 1, 2 or 4 heads interleaved (docs/gdn_pallas_tpu.md,
# "VMEM model").
_LONG_BWD_FROM, _LONG_BWD_HEADROOM = 4096, 5 * _MIB // 4
# v5e's forms (`pallas_mosaic_tpu_common.Static.v5e_forms`: f32
# concatenations and roundings) take more of the backward's VMEM than the
# fit (made on tpu7x) counts: 53.21 MiB where it said 51.75 (64 value
# heads, C = 128, 8 interleaved, T = 4096), 41.5 where 40.1 (32 heads, 16
# interleaved, the kernel alone). The backward's estimate there is this
# much larger.
_V5E_BWD_FACTOR = 33 / 32
# The forward's growth past the same length: 8 heads interleaved, tpu7x,
# Qwen3-Next heads, 16.68 -- 17.0 MiB at T=4096, 18.68 -- 19.0 MiB at
# T=32768 with an initial state.
_LONG_FWD_HEADROOM = 2 * _MIB


# float32 inputs (three-pass products: hi / lo pieces of every operand) take
# this many more C x V f32 blocks per value head (whatever the interleave)
# than the bf16 fit counts: ahead of time at Qwen3-Next heads (Hk 16, Hv 32),
# T = 4096, C = 128, the backward needed 56.36 MiB on v5e (8 heads
# interleaved compiled), 57.08 on v6e, where the fit said 47.12; the forward
# 24.5 on tpu7x where it said 18.6, and on v5e at 64 value heads 54.64 /
# 54.71 with 16 / 8 heads interleaved where it said 32.25 / 28.5; the
# backward at C = 64 on tpu7x 23.17 where it said 20.6 (docs/gdn_pallas_tpu.md,
# "VMEM model"). The states pass is counted as the forward.
_F32_BLOCKS = {"bwd": 5, "fwd": 7, "states": 7}


def vmem_estimate(*, chunk: int, hv: int, hk: int, dim_k: int, dim_v: int, itemsize: int,
                  interleave: int, kernel: Literal["fwd", "states", "bwd"],
                  save_states: bool = False, length: int = 0, v5e_forms: bool = False) -> int:
  """Scoped VMEM one grid step of `kernel` needs ("fwd": outputs, and with
  `save_states` the residual blocks too; "states": the VJP's first pass;
  "bwd").

  The kernel's f32 scratch (the state or dS, the head-major copies of the
  blocks, the gate rows), exactly; plus what Mosaic allocates itself: a part
  proportional to one chunk of q, k, v in f32 (1× in the forward, 2× in the
  states pass, 2.25× in the backward), the C×C / C×D f32 tiles live per
  interleaved head (7 in the forward, 6 in the states pass, 12 in the
  backward: 10 before the prologue ran
  in the kernels; it took the backward at C=64, 8 heads, T=4096 from 20.72 to
  21.04 MiB, over tpu7x's 21 MiB, and the estimate from 0.35 MiB under the
  measurement to 0.65 over), and about one more copy of
  the token blocks (input dtype; half of them in the forward kernels), which
  Mosaic keeps at long sequences and the estimate adds at every length. Past
  T = 4096 (`length`, 0 if unknown) the backward's scoped allocation grows
  by up to another MiB, so the backward estimate then adds
  `_LONG_BWD_HEADROOM` per 16 value heads, and the forward's by up to 2 MiB
  (`_LONG_FWD_HEADROOM`): so tpu7x's forward interleaves 16 heads up to
  T = 4096 (24 % fewer cycles than 8 at Qwen3-Next heads, T=512) and 8
  past it, where 16 no longer fits. v5e/v6e need more for the backward, which their
  larger `vmem_cap` leaves room for.

  `v5e_forms`: the kernels as traced for v5e, whose backward takes more
  (`_V5E_BWD_FACTOR`).

  The coefficients are fitted to the compiler's own scoped allocation, which
  Mosaic reports when a kernel is compiled (`tokamax_gdn.aot`, as
  `tokamax-gdn aot` does) with a `vmem_limit_bytes` too small for it; the
  measured points and this estimate beside them are in
  docs/gdn_pallas_tpu.md, "VMEM model".
  """
  dim_k, dim_v = round_up(dim_k, 128), round_up(dim_v, 128)
  state = hv * dim_k * dim_v * 4
  rows = 8 * hv * round_up(chunk, 128) * 4
  key, value = chunk * hk * dim_k * 4, chunk * hv * dim_v * 4
  tile = max(chunk, 128) * max(chunk, dim_k, dim_v) * 4   # C=64 tiles: as if 128 rows
  residuals = hv * (dim_k * dim_v + chunk * chunk) * itemsize
  f32 = _F32_BLOCKS[kernel] * value if itemsize == 4 else 0
  if kernel == "bwd":
    # dq, dk, dv's head-major scratch counted as in the fits (2 key + 1
    # value), though the kernel now writes them into their output blocks
    # (`bwd_kernel`): that much margin, not refitted; so are q, k, v and
    # dO's copies where the kernel reads them from their blocks
    # (`common.Static.bwd_copies`: v5e and tpu7x).
    scratch = state + 4 * key + 3 * value + rows
    blocks = (4 * key + 3 * value) * itemsize // 4 + residuals
    long = _LONG_BWD_HEADROOM * max(1, hv / 16) if length > _LONG_BWD_FROM else 0
    need = scratch + 9 * (2 * key + value) // 4 + blocks + interleave * 12 * tile + long + f32
    return int(need * _V5E_BWD_FACTOR) if v5e_forms else int(need)
  values = 2 if kernel == "fwd" else 1
  # q's, k's and v's head-major scratch counted as in the fits, also where
  # the kernels now read them from their blocks (`common.head_copies`: all
  # but the packed input's, and q and k normalised in place on tpu7x): one
  # chunk of each in f32 of margin there, not refitted (tpu7x, Qwen3-Next
  # heads, T=4096, C=128, 16 heads: the forward compiled at 17 MiB, not 16,
  # with v in scratch, at 15, not 14, without).
  scratch = state + 2 * key + values * value + rows
  blocks = (2 * key + values * value) * itemsize // 4
  if kernel == "states":
    blocks += residuals
    return scratch + 2 * (2 * key + value) + blocks // 2 + interleave * 6 * tile + f32
  # The forward, refitted since its blocks are [B, T, H D] (no relayout in
  # the kernel): one copy of the q, k, v chunk in f32 where Mosaic had two,
  # 7 tiles per head where it had 6 (tpu7x, Qwen3-Next heads, T=4096, C=128:
  # 16.68 -- 17.0 / 20.05 -- 20.5 MiB with 8 / 16 heads, estimated 17.1 /
  # 20.6; 23.0 MiB with 16 heads and the relayout). The states pass is not
  # refitted.
  written = residuals if save_states else 0
  long = _LONG_FWD_HEADROOM if length > _LONG_BWD_FROM else 0
  return scratch + (2 * key + value) + blocks // 2 + written + interleave * 7 * tile + long + f32


# `requests_vmem_estimate`: Mosaic's own scoped VMEM in the request-packed
# forward, a fixed part and C x V f32 tiles per value head (3 for bf16
# inputs, 5 for float32 ones: three-pass products), the largest measured on
# v5e with a quarter to a half tile to spare (the measured points:
# tests/ops/causal_conv1d_gated_delta_rule/pallas_mosaic_tpu_test.py,
# `_REQUESTS_VMEM_V5E`).
_REQUESTS_FIXED = _MIB // 2
_REQUESTS_TILES_PER_HEAD = {1: 3, 3: 5}


def requests_vmem_estimate(*, chunk: int, hv: int, hk: int, dim_k: int, dim_v: int,
                           itemsize: int, pool_itemsize: int) -> int:
  """Scoped VMEM one grid step of the serving op's request-packed forward
  (`pallas_mosaic_tpu_requests.gdn_fwd_requests`) needs, an upper bound on
  every generation (measured on v5e, whose forms need the most: v6e and
  tpu7x took 86-94 % of it at 64 value heads).

  Counted exactly: its pipelined blocks, two buffers each (the (C, 2 Hk K +
  Hv V) qkv chunk, the (C, Hv) log-decay and beta in f32, the (C, Hv V)
  output and the output base it updates, in the input dtype), and its
  scratch (the f32 state, the row scratch, q and k head-major, v and the
  output head-major, the state pool's DMA buffer in the pool's dtype). Plus
  Mosaic's own: `_REQUESTS_FIXED` and `_REQUESTS_TILES_PER_HEAD` C x V f32
  tiles per value head (with every head group unrolled it grows with Hv,
  not with the interleave: 16 or 8 heads interleaved took the same at 64
  heads, 4 took 3.5 MiB more).

  The training forward's `vmem_estimate(kernel="fwd")` is no model of this
  kernel: it has no output base or pool buffer and its Mosaic part is per
  interleaved head, so at 64 value heads, C=128, bf16 it estimated 29.7 MiB
  where Mosaic allocates 41.1 (v5e; 36.1 on v6e, 35.4 on tpu7x), and the
  serving op's limit of a quarter more (37.2 MiB) failed on the chip at
  every 64-head prefill of 1024 tokens or more. Shorter calls kept their
  token arrays where XLA put them (in VMEM: 28.8 MiB scoped then), so this
  bounds the case whose arrays are in HBM. Independent of T and of the
  number of requests (measured: T = 256 to 8192, 1 and 8 requests).
  """
  dim_k, dim_v = round_up(dim_k, 128), round_up(dim_v, 128)
  lanes = lambda n: round_up(n, 128)
  rows = max(chunk, 8)
  qkv = rows * lanes(2 * hk * dim_k + hv * dim_v) * itemsize
  gates = 2 * rows * lanes(hv) * 4
  out = rows * hv * dim_v * itemsize          # the output and its base, each
  blocks = 2 * (qkv + gates + 2 * out)
  tile = rows * dim_v * 4
  scratch = (hv * dim_k * dim_v * (4 + pool_itemsize)                     # s, h0_buf
             + kernel_prologue.N_ROWS * round_up(hv, 8) * lanes(chunk) * 4  # rows
             + 2 * hk * rows * dim_k * 4 + 2 * hv * tile)                 # qh, kh, vh, out_heads
  passes = 1 if itemsize == 2 else 3
  internal = _REQUESTS_FIXED + _REQUESTS_TILES_PER_HEAD[passes] * hv * tile
  return blocks + scratch + internal


def vmem_cap(gen: gdn_config.TpuGeneration) -> int:
  """The scoped VMEM limit we give the kernels on `gen`, and the most a config
  may estimate to need: (VMEM - 22 MiB) / 2 (53 MiB on v5e/v6e, 21 on tpu7x).

  The compiled program's VMEM is about the scoped limit, plus what the kernel
  uses of it, plus XLA's own, which grows with T. So a larger limit can fail
  where a smaller one compiles; the compiles that set 22 MiB (`tokamax-gdn
  aot --target v6e|tpu7x`, memory at --seq-len) are in
  docs/gdn_pallas_tpu.md, "VMEM model".
  """
  return (gen.vmem_bytes - 22 * _MIB) // 2


# Compiled ahead of time (a TPU target, no TPU attached), the kernels get
# this much less than `vmem_cap`. On the v5e chip XLA may place a kernel's
# small operands in VMEM, and they then count in the kernel's scoped
# allocation; ahead of time it does not. The float32 backward at Qwen3-Next's
# heads, T = 4096, allocated 49.93 MiB compiled ahead of time for v5e and
# 53.93 MiB on the chip (past the 53.00 limit: the compile failed there),
# the 4 MiB being the two [T, Hv] float32 gate arrays (lanes padded to 128)
# that XLA put in VMEM. With the slack, a kernel that compiles ahead of time
# leaves room for them. Only on the 128 MiB-VMEM generations (v5e, and v6e
# with the same cap): tpu7x's 21 MiB cap, which no chip here has measured,
# would lose a fifth to it, and its heuristics' configs would no longer fit.
AOT_SLACK = 9 * _MIB // 2


def kernel_vmem_limit(gen: gdn_config.TpuGeneration) -> int:
  """The `vmem_limit_bytes` the GDN kernels get: `vmem_cap`, less `AOT_SLACK`
  when compiled ahead of time (on a host without a TPU) for a generation
  with 128 MiB of VMEM."""
  ahead_of_time = jax.default_backend() != "tpu"
  slack = AOT_SLACK if ahead_of_time and gen.vmem_bytes >= 128 * _MIB else 0
  return vmem_cap(gen) - slack


def accepted_need(cap: int) -> int:
  """The largest VMEM estimate `check_vmem` lets through: the cap and an
  eighth (the estimates round up: they are fitted above Mosaic's reports)."""
  return cap + cap // 8


def check_vmem(op_name: str, need: int, cap: int, what: str) -> None:
  """Raises before anything is compiled where a kernel's VMEM estimate is past
  the cap: Mosaic's own failure comes only at compile time, as a
  `CompileTimeScopedVmemOom` that names neither the op nor the config. Only a
  need past `accepted_need(cap)` is refused: the heuristics' last resort (one
  GVA group at C = 64) may sit just above the cap and compiles.
  """
  if need > accepted_need(cap):
    gen = gdn_config.target_generation()
    raise ValueError(
        f"{op_name} pallas_mosaic_tpu: {what} needs about {need / _MIB:.1f} MiB of VMEM,"
        f" over the {cap / _MIB:.1f} MiB its kernels may use on {gen.name}; pick a smaller"
        " config (or config=None for the heuristics) or another implementation.")
