"""The request-packed Pallas GDN forward of the serving op.

`gdn_fwd_requests` runs the forward kernel over the requests of one packed
token row: q, k, v are lane ranges of one qkv input, the grid is a list of
work items (`_item_table`: a C-token block and a request touching it), and
states come from and go to slots of a state pool in place. Algebra:
`docs/gdn_math.md`; design: `docs/gdn_pallas_tpu.md`.
"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
from jaxtyping import Array, Float  # pylint: disable=g-multiple-import,g-importing-member

from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_call as call
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_fwd_kernel as fwd_kernel
from tokamax_gdn.ops.gated_delta_rule import prologue

F32, BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class PackedRequests:
  """Up to N requests on one packed token row for `gdn_fwd_requests`.

  Lane n holds request [start_n, start_n + length_n) (length 0: an unused
  lane), starting from the state pool's slot read_n where init_n (else from
  zeros), its final state written to slot write_n. Used lanes are in token
  order; no lane reads a slot another one writes.
  """

  start: jax.Array    # [N] int32
  length: jax.Array   # [N] int32
  init: jax.Array     # [N] bool
  read: jax.Array     # [N] int32
  write: jax.Array    # [N] int32


def num_items(t_len: int, lanes: int, chunk: int) -> int:
  """Work items of `lanes` requests on T tokens: the blocks each spans, at
  most ceil(T / C) + lanes - 1 (two disjoint requests share a block at most
  at their boundary)."""
  return -(-t_len // chunk) + lanes - 1


def _item_table(req: PackedRequests, t_len: int, chunk: int):
  """Per work item j (a C-token block of the row and one request touching it,
  in token order): (block, read slot, write slot, flags = run | enter << 1 |
  leave << 2 | init << 3 | lo << 4 | hi << 12 | fresh << 20: the request's
  rows [lo, hi) of the block; fresh: the block's first item), int32 [J] each.

  Items past the last one repeat its block, lane and slot with run = 0: their
  index maps fetch nothing new and the kernel skips them.
  """
  n = req.start.shape[0]
  big = num_items(t_len, n, chunk)
  used = req.length > 0
  first = req.start // chunk
  count = jnp.where(used, (req.start + req.length - 1) // chunk - first + 1, 0)
  ends = jnp.cumsum(count)
  total = ends[-1]
  j = jnp.arange(big, dtype=jnp.int32)
  jj = jnp.minimum(j, jnp.maximum(total - 1, 0))
  lane = jnp.minimum(jnp.sum((ends[None, :] <= jj[:, None]).astype(jnp.int32), axis=1), n - 1)
  i = jj - (ends - count)[lane]
  block = jnp.clip(first[lane] + i, 0, -(-t_len // chunk) - 1)
  lo = jnp.clip(req.start[lane] - block * chunk, 0, chunk)
  hi = jnp.clip(req.start[lane] + req.length[lane] - block * chunk, 0, chunk)
  fresh = jnp.concatenate([jnp.ones((1,), bool), block[1:] != block[:-1]])
  flags = ((j < total).astype(jnp.int32) | (i == 0).astype(jnp.int32) << 1
           | (i == count[lane] - 1).astype(jnp.int32) << 2
           | req.init[lane].astype(jnp.int32) << 3 | lo << 4 | hi << 12
           | fresh.astype(jnp.int32) << 20)
  return block.astype(jnp.int32), req.read[lane], req.write[lane], flags


def gdn_fwd_requests(qkv: Float[Array, "T D"], log_decay: Float[Array, "T Hv"],
                     beta: Float[Array, "T Hv"], state_pool: Float[Array, "S Hv K V"],
                     requests: PackedRequests, out_base: Float[Array, "T HvV"], *, hk: int,
                     hv: int, dim_k: int, dim_v: int, scale: float, chunk=128, interleave=16,
                     newton=None, all_run: bool = False, static_blocks: bool = False,
                     in_hbm: bool = False, interpret=False, vmem_limit_bytes=None):
  """The chunked GDN forward over the requests of one packed token row (the
  serving op's chunked path).

  q, k, v are lane ranges of qkv [T, 2 Hk K + Hv V] (K, V multiples of 128, the
  serving op pads shorter heads: heads are aligned lane slices of a block, no
  relayout); q and k are
  L2-normalised in the kernel (`prologue.l2norm`, float32), k and v read as
  0 where beta is 0 (`kernel_prologue.packed_heads`). The grid is a list of work items
  (`_item_table`, scalar-prefetched): one per C-token block and request
  touching it, in token order, at most ceil(T / C) + N - 1. An item runs
  its request's rows [lo, hi) of the block; the block's other tokens count
  as beta 0 and log-decay 0 (they pass the state through; a NaN there is
  selected away) and their output rows are left as they are: the output
  block stays resident across the items of one block, its first item loads
  it from `out_base` (aliased: the output updates it in place). A request's
  first item DMAs its initial state from its read slot of `state_pool` (any
  float dtype; zeros where not `init`), its last DMAs the final state into
  its write slot (aliased, in place). Blocks stay aligned: Mosaic's pipeline
  takes no element offset it cannot prove tile-aligned.

  Items past the requests' blocks (all of them in a decode batch) do nothing
  and move nothing: their index maps repeat the last block and the body is
  under `pl.when` of the run flag. libtpu's static estimate counts a
  skipped body as nothing (the block DMAs still count), and a DMA of a
  data-dependent, repeated block index as nothing either. So a call
  whose requests run no block costs its empty steps.

  The estimator aborts on this kernel as it runs ("No DMA issue node found
  for sync flag", v6e and tpu7x), whenever its blocks' indices come from
  SMEM (with the state blocks pipelined too, and the final-state write and
  initial-state read both under branches on SMEM flags); the same kernel at
  static block indices is estimated. `static_blocks` compiles it so, item j
  on block min(j, ceil(T/C) - 1), for estimates only (results meaningless):
  every item then moves its blocks, at least the real kernel's traffic.
  `all_run` (with `static_blocks`) compiles one item per block, each
  running: the cost model of a call whose chunked requests cover the
  blocks, one item each (a prefill, or tp8_mixed_64_t8192's prefill after
  63 decodes: the real kernel runs 64 of its ceil(T/C) + N - 1 = 127 items
  and skips the rest; running all 127 had counted every skipped item as a
  whole block, twice the prefill's own cost). Without it the static-block estimate is that of a call
  whose items are all skipped.

  `in_hbm`: qkv and out_base (so out) stay in HBM (else XLA may place them
  in VMEM; see the serving op's `_HBM_TOKEN_BYTES`). Keeping log_decay and
  beta there too made libtpu's estimator abort on the static-block kernel
  (v6e, 4096 tokens: "No DMA issue node found for sync flag").

  Returns (out [T, Hv V] in qkv's dtype, state_pool): `out_base` with the
  requests' output rows written, and the pool with their final states.
  """
  t, width = qkv.shape
  if width != 2 * hk * dim_k + hv * dim_v:
    raise ValueError(f"qkv {qkv.shape}: expected 2 hk dim_k + hv dim_v ="
                     f" {2 * hk * dim_k + hv * dim_v} lanes.")
  if chunk > 255:
    raise ValueError(f"gdn_fwd_requests: chunk {chunk} > 255 (8-bit row bounds per item).")
  n = requests.start.shape[0]
  items, blocks = num_items(t, n, chunk), -(-t // chunk)
  passes = 1 if qkv.dtype == BF16 else 3
  st = common.Static(t_len=t, chunk=chunk, hk=hk, hv=hv, dim_k=dim_k, dim_v=dim_v,
               scale=float(scale), passes=passes,
               newton=common.default_newton(passes) if newton is None else newton,
               interleave=common.normalize_interleave(interleave, hv, hv // hk), has_seg=False,
               has_h0=True, packed=True, qk_l2norm=True, beta_guard=True, requests=True,
               gated=not all_run, v5e_forms=common.v5e_forms(), unroll_groups=common.unroll_groups())
  block, read, write, flags = _item_table(requests, t, chunk)
  if all_run:
    flags = flags | 1
  if static_blocks:
    pick = lambda j, _: jnp.minimum(j, blocks - 1)
  else:
    pick = lambda j, ref: ref[j]
  # Index maps take (0, j, block, read, write, flags).
  rows = lambda width: pl.BlockSpec((chunk, width), lambda b, j, *refs: (pick(j, refs[0]), 0))
  state = pl.BlockSpec(memory_space=pl.ANY)    # moved by the kernel's DMAs
  out_base = out_base.astype(qkv.dtype)
  if in_hbm:
    qkv, out_base = (pltpu.with_memory_space_constraint(x, pltpu.HBM) for x in (qkv, out_base))
  inputs = [common.Operand("qkv", qkv, block=rows(width)),
            common.Operand("log_decay", log_decay, block=rows(hv)),
            common.Operand("beta", beta, block=rows(hv)),
            common.Operand("h0", state_pool, block=state),
            common.Operand("base", out_base, block=rows(hv * dim_v))]
  outputs = [common.Operand("out", block=rows(hv * dim_v),
                      shape=jax.ShapeDtypeStruct((t, hv * dim_v), qkv.dtype)),
             common.Operand("pool", block=state,
                      shape=jax.ShapeDtypeStruct(state_pool.shape, state_pool.dtype))]
  scratch = ([common.Operand("s", shape=pltpu.VMEM((hv, dim_k, dim_v), F32))]
             + call.head_scratch(st, ("vh", "out_heads"))
             + [common.Operand("h0_buf", shape=pltpu.VMEM((hv, dim_k, dim_v), state_pool.dtype)),
                common.Operand("sem", shape=pltpu.SemaphoreType.DMA((2,)))])
  res = call.pallas_call(functools.partial(fwd_kernel.fwd_kernel, write_out=True, emit=False), st,
              dict(item_block=block, item_slot=read, item_write=write, item_flags=flags),
              grid=(1, blocks if all_run and static_blocks else items), inputs=inputs,
              outputs=outputs, scratch=scratch,
              vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, name="gdn_fwd_requests",
              aliases=dict(base="out", h0="pool"))
  return res["out"], res["pool"]
