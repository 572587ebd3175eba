"""Pallas Mosaic TPU decode kernel of the serving GDN: conv window + GDN step,
fused. This file holds its call (blocks, scratch, aliases, grid); the kernel
is in three more, one concern each:

- `pallas_mosaic_tpu_decode_static.py`: `DecodeStatic`, the compile-time
  description, and the VMEM model the Op wrapper checks before compiling;
- `pallas_mosaic_tpu_decode_kernel.py`: the body: request metadata in SMEM,
  the state DMAs, the loops over a tile's requests;
- `pallas_mosaic_tpu_decode_step.py`: the arithmetic of a token's GDN step
  and of a verify window's tokens at once.

Activations: for one-token decodes (`direct`) the kernel's blocks are the
token arrays themselves, request r's row being token r (a decode batch:
decode requests first, one token each); a request whose token is elsewhere
(a short prefill after the decodes) reads its row and writes its output row
by the aligned block DMAs of `mid_tokens`. The output stays in VMEM for the
whole grid where it is small (`resident_rows`: every row written where it
is, no XLA op after the kernel); else those rows go to a second output,
zeroed by the first grid step, and the op's output is the sum of the two.
This drops the XLA row gathers
of qkv / b / a and of the output. Verify windows take gathered blocks (row
r * window + t).

"""

import dataclasses
import functools

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_decode_kernel import (  # pylint: disable=g-importing-member
    kernel)
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_decode_static import (  # pylint: disable=g-importing-member
    BLOCK_ROWS, DecodeStatic, META_ROWS, bcast_slots, fill_rows, n_index, padded_requests,
    state_slots)
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule.pallas_mosaic_tpu_decode_step import (  # pylint: disable=g-importing-member
    ROWS)

F32 = jnp.float32


def decode(index, xs, bs, as_, taps, bias, a_log, dt_bias, conv_pool, rec_pool, qkv=None,
           b=None, a=None, *, st: DecodeStatic, interpret=False, vmem_limit_bytes=None):
  """Runs the decode kernel over R_padded = `padded_requests(st)` requests
  (the tiles of them `grid_steps` visits).

  index: the call's int32 index arrays (query_start_loc [R + 1],
    state_indices, distribution [3], seq_lens, then read_state_indices and
    read_offsets [R] where `st.has_reads` / `st.has_offsets`); the kernel
    derives each request's metadata from them. xs [R_padded * window, D],
    bs / as_ [R_padded * window, Hv]: each request's first `window` tokens
    (row r * window + t); with `st.direct`, None (the kernel's blocks are
    the token arrays qkv, b, a: row r is request r's token where its start
    is r). taps [W, D] (tap w multiplies the input W-1-w back), bias [1, D]
    (None where not `st.has_bias`), a_log and dt_bias [1, Hv], in their
    dtypes. With `st.mid_tokens`, qkv / b / a are the whole [T, ...] arrays
    (rows past the window are read from there).

  Returns (out [R_padded * window, Hv V] in the activations' dtype, out_mid
  [T, Hv V] or None, conv_pool, rec_pool) with the pools updated in place.
  out_mid holds the rows of tokens past a request's window (other rows
  undefined); with `st.direct`, every token row that is not `out`'s own
  (row t of `out` is request t's token if that request runs and starts at
  t, else zero) and zeros where no request runs, so that the output is
  out + out_mid. With `st.resident_rows`, out is the whole output
  [resident_rows, Hv V] (token rows first, zeros where no request runs) and
  out_mid is None.
  """
  r_pad = padded_requests(st)
  tile, n_w, dim, hv = st.tile, st.window, st.dim, st.n_v
  n_idx = n_index(st)
  assert len(index) == n_idx
  block = lambda width: pl.BlockSpec((tile * n_w, width), lambda i, *_: (i, 0))
  full = lambda *shape: pl.BlockSpec(shape, lambda i, *_: (0,) * len(shape))
  anyspace = pl.BlockSpec(memory_space=pl.ANY)
  t_len = 0 if qkv is None else qkv.shape[0]
  t_pad = -(-t_len // BLOCK_ROWS) * BLOCK_ROWS
  # Padded to whole BLOCK_ROWS-row blocks (the mid tokens' aligned DMAs) and, in
  # direct mode, to at least one row per request (the blocks).
  n_rows = max(t_pad, r_pad) if st.direct else t_pad
  pad = lambda x: x if x.shape[0] == n_rows else jnp.pad(x, ((0, n_rows - x.shape[0]), (0, 0)))
  if st.direct:
    assert st.mid_tokens and n_w == 1
    xs, bs, as_ = pad(qkv), pad(b), pad(a)
  params = [taps] + ([bias] if st.has_bias else []) + [a_log, dt_bias]
  in_specs = [block(dim), block(hv), block(hv)] + [full(*x.shape) for x in params]
  args = [xs, bs, as_] + params
  if st.mid_tokens:
    in_specs += [anyspace] * 3
    args += [xs, bs, as_] if st.direct else [pad(x) for x in (qkv, b, a)]
  in_specs += [anyspace, anyspace]
  # The pools stay in HBM, pinned: XLA otherwise moves small ones into VMEM
  # beside the kernel's own buffers (on v5e a 65-slot TP8 pool ran the
  # compile out of scoped VMEM), and only the DMAs touch them anyway.
  conv_pool, rec_pool = (pltpu.with_memory_space_constraint(x, pltpu.HBM)
                         for x in (conv_pool, rec_pool))
  args += [conv_pool, rec_pool]
  out_dtype = xs.dtype
  resident = st.resident_rows > 0
  if resident:
    assert st.direct and st.resident_rows == n_rows
    assert st.tile % BLOCK_ROWS == 0 or st.tile == r_pad, "resident rows move in whole blocks"
    out_specs = [full(n_rows, hv * st.d_v)]
    out_shape = [jax.ShapeDtypeStruct((n_rows, hv * st.d_v), out_dtype)]
  else:
    out_specs = [block(hv * st.d_v)]
    out_shape = [jax.ShapeDtypeStruct((r_pad * n_w, hv * st.d_v), out_dtype)]
  if st.mid_tokens and not resident:
    out_specs.append(anyspace)
    out_shape.append(pltpu.HBM((t_pad, hv * st.d_v), out_dtype))
  out_specs += [anyspace, anyspace]
  out_shape += [jax.ShapeDtypeStruct(conv_pool.shape, conv_pool.dtype),
                jax.ShapeDtypeStruct(rec_pool.shape, rec_pool.dtype)]
  n_in = n_idx + len(args)        # + the scalar-prefetch operands
  aliases = {n_in - 2: len(out_shape) - 2, n_in - 1: len(out_shape) - 1}
  kw1 = st.kernel_size - 1
  scratch = [
      pltpu.VMEM((tile, kw1, dim), conv_pool.dtype),
      pltpu.VMEM((tile, hv, st.d_k, st.d_v), rec_pool.dtype),
      pltpu.VMEM((tile, n_w, kw1, dim), conv_pool.dtype),
      pltpu.VMEM((tile, n_w, hv, st.d_k, st.d_v), rec_pool.dtype),
      pltpu.VMEM((state_slots(st), kw1, dim), F32),
      pltpu.VMEM((tile if n_w == 1 else state_slots(st) * n_w, dim), F32),
      pltpu.VMEM((bcast_slots(st), 2, st.d_k, st.d_v), F32),
      pltpu.VMEM((state_slots(st), hv, st.d_k, st.d_v), F32),
      pltpu.SemaphoreType.DMA((2, tile)),
      pltpu.SemaphoreType.DMA((2, tile, n_w)),
      pltpu.SMEM((META_ROWS, tile), jnp.int32),
  ]
  if n_w > 1:   # `Window`'s key columns, per request in flight
    scratch.append(pltpu.VMEM((state_slots(st), st.n_kq, st.d_k, -(-n_w // ROWS) * ROWS),
                              F32))
  if st.rolled:
    assert tile % st.rolled == 0, (tile, st.rolled)
    # The rolled loop's f32 rows: n_w = 1: [x; q | k | v], [beta; decay]
    # (the prepared tile), and the output rows; else per request x, [b; a]
    # and the output (window, L).
    if n_w == 1:
      scratch += [pltpu.VMEM((2, tile, dim), F32), pltpu.VMEM((2, tile, hv), F32),
                  pltpu.VMEM((tile, hv * st.d_v), F32)]
    else:
      scratch += [pltpu.VMEM((tile, n_w, dim), F32), pltpu.VMEM((2, tile, n_w, hv), F32),
                  pltpu.VMEM((tile, n_w, hv * st.d_v), F32)]
  if st.mid_tokens:
    scratch += [pltpu.VMEM((BLOCK_ROWS, dim), qkv.dtype), pltpu.VMEM((BLOCK_ROWS, hv), b.dtype),
                pltpu.VMEM((BLOCK_ROWS, hv), a.dtype),
                pltpu.VMEM((BLOCK_ROWS, hv * st.d_v), out_dtype),
                pltpu.SemaphoreType.DMA((6,))]
  if st.direct:
    scratch += [pltpu.VMEM((tile, dim), F32), pltpu.VMEM((tile, hv), F32),
                pltpu.VMEM((tile, hv), F32),
                pltpu.VMEM((tile if resident else fill_rows(t_pad), hv * st.d_v), out_dtype)]
  res = pl.pallas_call(
      functools.partial(kernel, st=dataclasses.replace(st, interpret=True) if interpret else st),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=n_idx, grid=(grid_steps(st, index, t_len),), in_specs=in_specs,
          out_specs=out_specs, scratch_shapes=scratch),
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=pltpu.CompilerParams(dimension_semantics=("arbitrary",),
                                           vmem_limit_bytes=vmem_limit_bytes),
      interpret=interpret,
      name="gdn_serve_decode",
  )(*index, *args)
  if resident:
    (out, conv_pool, rec_pool), out_mid = res, None
  elif st.mid_tokens:
    out, out_mid, conv_pool, rec_pool = res
    out_mid = out_mid if t_pad == t_len else out_mid[:t_len]
  else:
    (out, conv_pool, rec_pool), out_mid = res, None
  return out, out_mid, conv_pool, rec_pool


def grid_steps(st: DecodeStatic, index, t_len: int):
  """The grid's steps: one per tile of requests, R_padded / tile; in direct
  mode, where tiles lie wholly past the call's token rows, as many as the
  valid requests and the token rows need (traced: a dynamic grid).

  Only the tiles holding valid requests (r < distribution[2]) can run, and
  in direct mode only the first ceil(T / tile) tiles' output rows are the
  op's: a batch padded to a bucket of requests (64 of 512) visits its 8
  tiles, not 64, where a grid step that skips its tile still pays for its
  pipeline step and block copies (docs/performance.md, "chip-serving-padded"). Static where no tile lies past the token rows (a full
  decode batch: no scalar op before the kernel), for the cost model, and
  without `skip_idle`."""
  steps = padded_requests(st) // st.tile
  lo = max(1, -(-t_len // st.tile))
  if not st.direct or not st.skips_idle or lo >= steps:
    return steps
  valid = jnp.clip(index[2][2], 0, st.num_requests)
  return jnp.clip((valid + st.tile - 1) // st.tile, lo, steps).astype(jnp.int32)
