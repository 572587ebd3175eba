"""Host-side wrappers of the Pallas GDN kernels: `gdn_fwd` and `gdn_bwd`.

They move per-segment inputs to the chunk-aligned layout (`Segments`),
build the static config and the named operands (blocks, scratch), and call
the kernels through `pallas_call`. Algebra: `docs/gdn_math.md`; design:
`docs/gdn_pallas_tpu.md`.
"""

import collections
import dataclasses
import functools
import threading

import jax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_bwd_kernel as bwd_kernel
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_fwd_kernel as fwd_kernel
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kernel_prologue
from tokamax_gdn.ops.gated_delta_rule import prologue

F32, BF16 = jnp.float32, jnp.bfloat16


def _starts(segment_ids):
  """[B, 1, T] int32: 1 where a segment starts (never at t = 0)."""
  return segments.segment_starts(segment_ids).astype(jnp.int32)[:, None, :]



@dataclasses.dataclass(frozen=True)
class Chunks:
  """The chunk grid step i visits: i, or (`reverse`, the backward) nc - 1 - i."""

  nc: int
  reverse: bool = False

  def __call__(self, i):
    return self.nc - 1 - i if self.reverse else i


@dataclasses.dataclass(frozen=True)
class BlockIndex:
  """A BlockSpec's index map as a value: grid step (b, i) and the
  scalar-prefetched refs -> one block index per entry of `dims`: "b" (the
  batch row), "c" (the chunk, `chunks(i)`), "slot" (the state slot of that
  chunk's segment, from the per-segment codes: `common.code_slot`) or a
  fixed index. Equal calls build equal index maps, so that `pallas_call`
  can trace a kernel call once for all calls equal to it."""

  dims: tuple[str | int, ...]
  chunks: Chunks | None = None

  def __call__(self, b, i, *refs):
    def index(d):
      if d == "b":
        return b
      if d == "c":
        return self.chunks(i)
      if d == "slot":
        return common.code_slot(refs[0][b * self.chunks.nc + self.chunks(i)])
      return d
    return tuple(index(d) for d in self.dims)


def block(shape, *dims: str | int, chunks: Chunks | None = None) -> pl.BlockSpec:
  """`pl.BlockSpec(shape, BlockIndex(dims, chunks))`."""
  return pl.BlockSpec(shape, BlockIndex(dims, chunks))


@dataclasses.dataclass(frozen=True)
class _Segments:
  """Per-segment states ([B, N, Hv, K, V]) on the chunk-aligned layout of
  `segments.align_segments`: every segment n < N starts at a chunk boundary, so a
  chunk either continues the state or takes its segment's own (`_code_*`);
  later segments start in-chunk from zeros (the kernels' segment masks).
  """

  layout: segments.SegmentLayout
  code: jax.Array      # [B * Nc] int32: slot * 4 + reset * 2 + last

  @classmethod
  def build(cls, segment_ids, n_states: int, chunk: int) -> "_Segments":
    layout = segments.align_segments(segment_ids, n_states, chunk)
    slot = jnp.minimum(layout.chunk_segment, n_states)
    code = (slot * 4 + layout.chunk_reset.astype(jnp.int32) * 2
            + layout.chunk_last.astype(jnp.int32))
    return cls(layout, code.reshape(-1))

  @property
  def n_states(self) -> int:
    return self.layout.num_states

  def starts(self):
    """[B, 1, Ta] int32: the in-chunk starts (segments past N)."""
    return self.layout.in_chunk_starts().astype(jnp.int32)[:, None, :]

  def with_zero_slot(self, states):
    """[B, N, ...] -> [B, N + 1, ...] f32, slot N zeros (segments from N on)."""
    states = states.astype(F32)
    return jnp.concatenate([states, jnp.zeros_like(states[:, :1])], axis=1)

  def per_segment(self, states):
    """The kernel's [B, N + 1, ...] -> [B, N, ...], zeros past each row's
    segments (slots the kernel never wrote)."""
    n = self.n_states
    used = jnp.arange(n)[None, :] < self.layout.num_segments[:, None]
    return jnp.where(used[:, :, None, None, None], states[:, :n], 0.0)



def _steps(q, chunk: int, interpret) -> int | None:
  """The grid steps of a kernel call on q [B, T, ...] for `common.small_grid`;
  None in interpret mode, which runs the head groups in a loop anyway
  (`_interpret_static`) and keeps the interleave asked for."""
  return None if interpret else q.shape[0] * -(-q.shape[1] // chunk)


def _static(q, v, *, scale, chunk, interleave, newton, has_seg, has_h0, n_states=0,
            pro: kernel_prologue.Prologue = kernel_prologue.Prologue(), steps=None):
  b, t, hk, dim_k = q.shape
  hv, dim_v = v.shape[2], v.shape[3]
  passes = 1 if q.dtype == BF16 else 3
  if newton is None:
    newton = common.default_newton(passes)
  return common.Static(t_len=t, chunk=chunk, hk=hk, hv=hv, dim_k=dim_k, dim_v=dim_v,
                 scale=float(scale), passes=passes, newton=newton,
                 interleave=common.group_interleave(interleave, hv, hv // hk, steps),
                 has_seg=has_seg, has_h0=has_h0, n_states=n_states, v5e_forms=common.v5e_forms(),
                 qk_in_place=gdn_config.target_generation().name == "tpu7x",
                 unroll_groups=common.unroll_groups(steps=steps),
                 f_cols=common.f_sums_as_columns(),
                 paired_tmats=common.paired_tmats(), **pro.static())


def head_scratch(st: common.Static, values: tuple[str, ...], q: bool = True,
                 k: bool = True) -> list[common.Operand]:
  """Row scratch and head-major f32 copies: q (if `q`), k (if `k`), then the
  (Hv, C, V) arrays named in `values`."""
  heads = ("qh",) * q + ("kh",) * k
  return ([common.Operand("rows", shape=pltpu.VMEM((kernel_prologue.N_ROWS, st.hv, st.chunk), F32))]
          + [common.Operand(n, shape=pltpu.VMEM((st.hk, st.chunk, st.dim_k), F32)) for n in heads]
          + [common.Operand(n, shape=pltpu.VMEM((st.hv, st.chunk, st.dim_v), F32)) for n in values])


def _token_block(st: common.Static, chunks: Chunks, *dims: int) -> pl.BlockSpec:
  """The BlockSpec of one chunk of a [B, T, *dims] array: chunk `chunks(i)`
  at grid step (b, i).

  Per-head arrays ([B, T, H, D]: q, k, v, the output, their gradients) go to
  the kernels flat, [B, T, H D] (`_flat`), their blocks (C, H D): a head is
  an aligned lane slice of the block (`common.load_heads`, `common.store_heads`). As
  (C, H, D) blocks, tiled over (H, D), each head's rows were strided, and
  the kernels relaid each block out head-major (`einshape`) and the outputs
  back, a fifth of the forward's vector work. The reshape is free where the arrays
  come from a projection, as in the layer (XLA lays the [B, T, H D] product
  out for the kernel); a [B, T, H, D] argument at a jit boundary, in the
  default layout tiled over (H, D), is copied into it by XLA.
  """
  return block((None, st.chunk, *dims), "b", "c", *(0,) * len(dims), chunks=chunks)


def _flat(x):
  """[B, T, H, D] -> [B, T, H D] (`_token_block`)."""
  return x.reshape(*x.shape[:2], -1)


def _common_inputs(q, k, v, log_decay, beta, starts, st: common.Static, chunks: Chunks,
                   poison=None, pro: kernel_prologue.Prologue = kernel_prologue.Prologue()) -> list[common.Operand]:
  """The inputs both kernels read per chunk (array and BlockSpec each), the
  forward's poison rows when given, and the gate's a_log / dt_bias when the
  kernel activates it (`kernel_prologue.Prologue`)."""
  hk, hv = q.shape[2], v.shape[2]
  ops = [
      common.Operand("q", _flat(q), block=_token_block(st, chunks, hk * st.dim_k)),
      common.Operand("k", _flat(k), block=_token_block(st, chunks, hk * st.dim_k)),
      common.Operand("v", _flat(v), block=_token_block(st, chunks, hv * st.dim_v)),
      common.Operand("log_decay", log_decay, block=_token_block(st, chunks, hv)),
      common.Operand("beta", beta, block=_token_block(st, chunks, hv)),
  ]
  if poison is not None:   # [B, Hv, T]: a chunk's block is its rows (tokens in lanes)
    ops.append(common.Operand("poison", poison,
                              block=block((None, hv, st.chunk), "b", 0, "c", chunks=chunks)))
  if st.has_seg:
    ops.append(common.Operand("starts", starts,
                              block=block((None, 1, st.chunk), "b", 0, "c", chunks=chunks)))
  if st.gate_act:
    ops += [common.Operand(name, x, block=block((1, hv), 0, 0))
            for name, x in zip(("a_log", "dt_bias"), pro.gate_params())]
  return ops


def _state_spec(st: common.Static, chunks: Chunks):
  """The BlockSpec of a state-shaped operand: the row's [Hv, K, V] state, or
  with per-segment states the slot of the chunk's segment (`chunks.nc` is the
  aligned layout's number of chunks)."""
  if not st.n_states:
    return block((None, st.hv, st.dim_k, st.dim_v), "b", 0, 0, 0)
  return block((None, None, st.hv, st.dim_k, st.dim_v), "b", "slot", 0, 0, 0, chunks=chunks)


def _state_shape(st: common.Static, b: int) -> jax.ShapeDtypeStruct:
  lead = (b, st.n_states + 1) if st.n_states else (b,)
  return jax.ShapeDtypeStruct((*lead, st.hv, st.dim_k, st.dim_v), F32)


def _interpret_static(st: common.Static) -> common.Static:
  """`st` for Pallas interpret mode: unrolled head groups are a TPU
  scheduling choice (`common.run_groups`), which in interpret mode only makes
  XLA:CPU compile every group's copy (a test with two head groups: 9.0 ->
  13.3 s); `pallas_mosaic_tpu_test` runs them unrolled once."""
  return dataclasses.replace(st, unroll_groups=False, interpret=True)


def pallas_call(kernel, st: common.Static, prefetch: dict[str, jax.Array] | None, *, grid,
          inputs: list[common.Operand], outputs: list[common.Operand], scratch: list[common.Operand],
          vmem_limit_bytes, interpret, name, aliases: dict[str, str] | None = None
          ) -> dict[str, jax.Array]:
  """pallas_call of `kernel` on named operands; returns the outputs by name.

  The kernel gets its refs' names (`common.Refs`); the `prefetch` arrays (the
  per-segment chunk codes, "code", or `requests.gdn_fwd_requests`' work items) come
  first, as scalar prefetch into SMEM, readable by the index maps too.
  `aliases`: input name -> the output name that updates it in place.
  """
  if interpret:
    st = _interpret_static(st)
  prefetch = prefetch or {}
  names = tuple(prefetch) + tuple(o.name for o in (*inputs, *outputs, *scratch))
  args = [*prefetch.values(), *(o.array for o in inputs)]

  def build():
    params = pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                  vmem_limit_bytes=vmem_limit_bytes)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(prefetch), grid=grid, in_specs=[o.block for o in inputs],
        out_specs=[o.block for o in outputs], scratch_shapes=[o.shape for o in scratch])
    in_index = {o.name: len(prefetch) + i for i, o in enumerate(inputs)}
    out_index = {o.name: i for i, o in enumerate(outputs)}
    return pl.pallas_call(functools.partial(kernel, names=names, st=st), grid_spec=grid_spec,
                          out_shape=[o.shape for o in outputs], compiler_params=params,
                          interpret=interpret, name=name,
                          input_output_aliases={in_index[i]: out_index[o]
                                                for i, o in (aliases or {}).items()})

  key = _call_key(kernel, st, names, grid, inputs, outputs, scratch,
                  (vmem_limit_bytes, interpret, name, tuple(sorted((aliases or {}).items()))))
  res = (build() if key is None else _traced_call(key, build, name))(*args)
  return dict(zip((o.name for o in outputs), res))


# `pallas_call`s traced once per process for every call equal to them: the
# kernels of a model's layers, the forward program's kernel again in the
# step's, the programs `validate` compiles. Each entry is a `jax.jit` of the
# call: equal calls reuse its trace (the kernel body's Python, about half of
# lowering a GDN kernel), and calls of it in one program are lowered once
# there. At most `_TRACED_MAX` entries, least recently used out first.
# `cache_calls(False)` turns it off (to time lowering without it).
_TRACED: collections.OrderedDict = collections.OrderedDict()
_TRACED_MAX = 64
_TRACED_LOCK = threading.Lock()
_CACHE_CALLS = [True]


def cache_calls(enabled: bool) -> None:
  """Whether equal kernel calls share one trace (`_TRACED`); on by default."""
  _CACHE_CALLS[0] = enabled
  with _TRACED_LOCK:
    _TRACED.clear()


def _call_key(kernel, st: common.Static, names, grid, inputs, outputs, scratch, rest):
  """A hashable key equal for equal calls of `pallas_call`, or None where a
  call has an index map that is not a `BlockIndex` (a function compares by
  identity: such calls are not shared)."""
  if not _CACHE_CALLS[0]:
    return None
  specs = [o.block for o in (*inputs, *outputs)]
  if not all(isinstance(getattr(s.index_map, "index_map", None), BlockIndex) for s in specs):
    return None
  if isinstance(kernel, functools.partial):
    kernel = (kernel.func, kernel.args, tuple(sorted(kernel.keywords.items())))
  key = (kernel, st, names, tuple(grid),
         tuple((o.name, tuple(o.block.block_shape), o.block.index_map, o.block.memory_space,
                o.block.pipeline_mode) for o in (*inputs, *outputs)),
         tuple(o.shape for o in (*outputs, *scratch)), rest)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _traced_call(key, build, name: str):
  """The `jax.jit` of `build()` (a pallas_call) shared by every call with `key`."""
  with _TRACED_LOCK:
    fn = _TRACED.get(key)
    if fn is not None:
      _TRACED.move_to_end(key)
      return fn
  call = build()

  def run(*args):
    return call(*args)

  run.__name__ = run.__qualname__ = name
  fn = jax.jit(run)
  with _TRACED_LOCK:
    _TRACED[key] = fn
    while len(_TRACED) > _TRACED_MAX:
      _TRACED.popitem(last=False)
  return fn


def _prepare(q, k, v, log_decay, beta, *, initial_state, segment_ids, chunk, scale,
             interleave, newton, interpret, poison=None, sanitize=False, guard=False,
             pro: kernel_prologue.Prologue = kernel_prologue.Prologue()):
  """(inputs, h0, starts, segments, static, number of chunks) of one kernel call.

  Per-segment states: the inputs (and `poison`, if given, last) moved to the
  aligned layout, the states with their zero slot, and the `_Segments`;
  otherwise the inputs as given."""
  xs = (q, k, v, log_decay, beta) + ((poison,) if poison is not None else ())
  if initial_state is None or initial_state.ndim != 5:
    starts = None if segment_ids is None else _starts(segment_ids)
    h0, seg = initial_state, None
  else:
    seg = _Segments.build(segment_ids, initial_state.shape[1], chunk)
    # Pads pass the state through: log-decay 0, from a raw gate of -inf when
    # the kernel activates it (-exp(a_log) softplus(-inf) = 0).
    fills = [0.0] * len(xs)
    fills[3] = -jnp.inf if pro.a_log is not None else 0.0
    xs = tuple(seg.layout.to_aligned(x, fill) for x, fill in zip(xs, fills))
    h0, starts = seg.with_zero_slot(initial_state), seg.starts()
  st = _static(xs[0], xs[2], scale=scale, chunk=chunk, interleave=interleave, newton=newton,
               has_seg=starts is not None, has_h0=h0 is not None,
               n_states=0 if seg is None else seg.n_states, pro=pro,
               steps=_steps(xs[0], chunk, interpret))
  if guard and seg is not None:
    raise NotImplementedError("the in-kernel guard does not take per-segment states.")
  st = dataclasses.replace(st, sanitize=sanitize and not guard, guard=guard)
  return xs, h0, starts, seg, st, -(-xs[0].shape[1] // chunk)


def gdn_fwd(q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"],
            v: Float[Array, "B T Hv V"], log_decay: Float[Array, "B T Hv"],
            beta: Float[Array, "B T Hv"], *, scale: float,
            initial_state: segments.State | None = None,
            segment_ids: Int[Array, "B T"] | None = None, chunk=128, interleave=16,
            newton=None, write_out=True, emit_residuals=False, final_state=True,
            interpret=False, vmem_limit_bytes=None, sanitize: bool = False,
            poison: Float[Array, "B T Hv"] | None = None, guard: bool = False,
            pro: kernel_prologue.Prologue = kernel_prologue.Prologue()):
  """Chunked GDN forward: on prepared inputs (after `prologue.prologue`), or
  with `pro` on the raw q, k and gate (`log_decay` is then the raw g when
  `pro.a_log` is given), the prologue in the kernel.

  The in-kernel half of the forward's `isolation.SegmentGuard`: with
  `sanitize`, non-finite k and v count as 0 (log-decays, betas and states
  come sanitised); `poison` (0, or NaN at the tokens whose outputs must be
  NaN) makes each poisoned token's output NaN. q is read as given (a
  non-finite query reaches its own output only).

  `guard` (not with per-segment states): the forward's whole
  `isolation.SegmentGuard` in the kernel, on the raw inputs and initial
  state (`guard.guard_fwd_rows`): the poisoned tokens' outputs and final state
  NaN, without `poison`; the residuals then hold a third array, the
  forward's flags [B, NC, Hv, C] f32 (1 at the tokens a bad input reaches)
  for `gdn_bwd(guard=True)`.

  Returns (out [B, T, Hv, V] in v.dtype or None without `write_out`,
  final_state f32 or None without `final_state`, residuals or None): with
  `emit_residuals`,
  (states [B, NC, Hv, K, V], tmats [B, NC, Hv, C, C]), the state entering
  each chunk and T' of each chunk, bf16 for bf16 inputs, else f32.

  `final_state=False`: the kernel has no final-state output at all (an
  output block the last chunk writes back is an HBM write nothing hides).

  `initial_state` [B, Hv, K, V] gives final_state [B, Hv, K, V];
  per-segment states [B, N, Hv, K, V] (with `segment_ids`) give each
  segment's end state [B, N, Hv, K, V], and the kernel then runs on the
  chunk-aligned layout (`_Segments`): NC counts its chunks.
  """
  xs, h0, starts, seg, st, nc = _prepare(
      q, k, v, log_decay, beta, initial_state=initial_state, segment_ids=segment_ids,
      chunk=chunk, scale=scale, interleave=interleave, newton=newton, interpret=interpret,
      poison=poison, sanitize=sanitize, guard=guard, pro=pro)
  q, k, v, log_decay, beta = xs[:5]
  b, t = q.shape[:2]
  poison_rows = (jnp.swapaxes(xs[5], 1, 2).astype(F32)
                 if poison is not None and write_out else None)
  inputs = _common_inputs(q, k, v, log_decay, beta, starts, st, Chunks(nc),
                          poison=poison_rows, pro=pro)
  out_block = _token_block(st, Chunks(nc), st.hv * st.dim_v)
  out_shape = jax.ShapeDtypeStruct((b, t, st.hv * st.dim_v), v.dtype)
  return _run_fwd(inputs, h0, st, seg, nc, b, out_block if write_out else None, out_shape,
                  emit_residuals=emit_residuals, final_state=final_state, interpret=interpret,
                  vmem_limit_bytes=vmem_limit_bytes)


def _run_fwd(inputs: list[common.Operand], h0, st: common.Static, seg: "_Segments | None", nc: int, b: int,
             out_block, out_shape, *, emit_residuals: bool, final_state: bool, interpret,
             vmem_limit_bytes):
  """The forward kernel's call on prepared inputs: adds the initial state, the
  outputs (`out` when `out_block` is given, the final state with
  `final_state`, the residuals)
  and the scratch; returns (out, final_state, residuals) as `gdn_fwd`."""
  write_out = out_block is not None
  chunk = st.chunk
  copies = common.head_copies(st, write_out)
  state_spec = _state_spec(st, Chunks(nc))
  if st.has_h0:
    inputs.append(common.Operand("h0", h0.astype(F32), block=state_spec))
  outputs = []
  if write_out:
    outputs.append(common.Operand("out", block=out_block, shape=out_shape))
  if final_state:
    outputs.append(common.Operand("final", block=state_spec, shape=_state_shape(st, b)))
  if emit_residuals:
    outputs += [
        common.Operand("states", block=_residual_block(st, Chunks(nc), st.dim_k, st.dim_v),
                       shape=jax.ShapeDtypeStruct((b, nc, st.hv, st.dim_k, st.dim_v), st.mm)),
        common.Operand("tmats", block=_residual_block(st, Chunks(nc), chunk, chunk),
                       shape=jax.ShapeDtypeStruct((b, nc, st.hv, chunk, chunk), st.mm))]
    if st.guard:
      outputs.append(_guard_fwd_operand(st, b, Chunks(nc)))
  scratch = ([common.Operand("s", shape=pltpu.VMEM((st.hv, st.dim_k, st.dim_v), F32))]
             + head_scratch(st, ("vh",) * copies[2] + ("out_heads",) * write_out,
                            q=copies[0], k=copies[1])
             + _guard_scratch(st, 1))
  res = pallas_call(
      functools.partial(fwd_kernel.fwd_kernel, write_out=write_out, emit=emit_residuals), st,
      None if seg is None else dict(code=seg.code),
      grid=(b, nc), inputs=inputs, outputs=outputs, scratch=scratch,
      vmem_limit_bytes=vmem_limit_bytes, interpret=interpret,
      name="gdn_fwd" if write_out else "gdn_fwd_states")
  out, final = res.get("out"), res.get("final")
  if out is not None:
    out = out.reshape(*out.shape[:2], st.hv, st.dim_v)
  if seg is not None:
    out = None if out is None else seg.layout.from_aligned(out)
    final = None if final is None else seg.per_segment(final)
  residuals = (res["states"], res["tmats"]) if emit_residuals else None
  if emit_residuals and st.guard:
    residuals += (res["guard_fwd"],)
  return out, final, residuals


def _residual_block(st: common.Static, chunks: Chunks, *dims: int) -> pl.BlockSpec:
  """The BlockSpec of a per-chunk residual [B, NC, Hv, *dims]: the chunk's."""
  return block((None, None, st.hv, *dims), "b", "c", 0, *(0,) * len(dims), chunks=chunks)


def _guard_fwd_operand(st: common.Static, b: int, chunks: Chunks, array=None) -> common.Operand:
  """The forward's guard flags [B, NC, Hv, C] f32 (`guard.guard_fwd_rows`): an
  output of the forward kernels, an input (`array`) of the backward."""
  spec = _residual_block(st, chunks, st.chunk)
  if array is not None:
    return common.Operand("guard_fwd", array, block=spec)
  return common.Operand("guard_fwd", block=spec,
                        shape=jax.ShapeDtypeStruct((b, chunks.nc, st.hv, st.chunk), F32))


def _guard_scratch(st: common.Static, n_rows: int) -> list[common.Operand]:
  """The guard's scratch (`common.Static.guard`): `n_rows` (Hv, C) flag rows and
  the flag carried along the chunks (Hv, 128); none without the guard."""
  if not st.guard:
    return []
  rows = (n_rows, st.hv, st.chunk) if n_rows > 1 else (st.hv, st.chunk)
  return [common.Operand("guard_rows", shape=pltpu.VMEM(rows, F32)),
          common.Operand("guard_carry", shape=pltpu.VMEM((st.hv, 128), F32))]


def gdn_bwd(q: Float[Array, "B T Hk K"], k: Float[Array, "B T Hk K"],
            v: Float[Array, "B T Hv V"], log_decay: Float[Array, "B T Hv"],
            beta: Float[Array, "B T Hv"], d_out: Float[Array, "B T Hv V"],
            d_final: segments.State | None, *, scale: float,
            initial_state: segments.State | None = None,
            segment_ids: Int[Array, "B T"] | None = None, residuals=None, chunk=128,
            interleave=16, newton=None, interpret=False, vmem_limit_bytes=None,
            sanitize=False, guard=False, pro: kernel_prologue.Prologue = kernel_prologue.Prologue()):
  """Chunked GDN backward: (dq, dk, dv, d_log_decay, dbeta, d_initial_state f32
  or None without `initial_state`: the kernel then has no such output).

  The gradients of the inputs come in their dtypes. With `pro` (the raw q, k
  and gate in, as `gdn_fwd`'s) they are those of the raw inputs (dq, dk
  through the L2 norm, d_log_decay that of the raw g), and with `pro.a_log`
  there are two more, [B, 1, Hv] f32 each: each batch row's part of
  a_log's gradient and of dt_bias's (the sum of d_log_decay's in float32);
  the gradients are their sums over B.

  `sanitize`: non-finite q, k, v and d_out count as 0 (the in-kernel half of
  the backward's `isolation.SegmentGuard`; the rest comes sanitised).
  `guard` (not with per-segment states): the whole of it in the kernels, on
  the raw inputs, states and cotangents (`guard.guard_bwd_rows`): every gradient
  of the poisoned tokens NaN, and a_log's parts of the heads with one.

  `residuals`: `gdn_fwd(emit_residuals=True)`'s (same `initial_state`,
  `segment_ids` and chunk), or None to recompute them (pass 1: the forward
  kernel without outputs). d_final and d_initial_state have the final
  state's shape ([B, N, Hv, K, V] for per-segment states).
  """
  if residuals is None:
    _, _, residuals = gdn_fwd(
        q, k, v, log_decay, beta, scale=scale, initial_state=initial_state,
        segment_ids=segment_ids, chunk=chunk, interleave=interleave, newton=newton,
        write_out=False, emit_residuals=True, final_state=False, interpret=interpret,
        vmem_limit_bytes=vmem_limit_bytes, sanitize=sanitize, guard=guard, pro=pro)
  t_in = q.shape[1]
  (q, k, v, log_decay, beta), h0, starts, seg, st, nc = _prepare(
      q, k, v, log_decay, beta, initial_state=initial_state, segment_ids=segment_ids,
      chunk=chunk, scale=scale, interleave=interleave, newton=newton, interpret=interpret,
      sanitize=sanitize, guard=guard, pro=pro)
  b, t = q.shape[:2]
  st = dataclasses.replace(st, unroll_groups=common.unroll_groups(
                               backward=True, steps=_steps(q, chunk, interpret)),
                           bwd_copies=common.bwd_head_copies(st), dk_sym=common.dk_symmetric(),
                           bwd_vnew=common.bwd_through_vnew())
  states, tmats = residuals[:2]
  if states.shape[1] != nc:
    raise ValueError(f"residuals for {states.shape[1]} chunks; this call has {nc}.")
  rev = Chunks(nc, reverse=True)
  inputs = _common_inputs(q, k, v, log_decay, beta, starts, st, rev, pro=pro)
  state_spec = _state_spec(st, rev)
  if d_final is None and not st.guard:   # (the guard's kernel reads none as zeros)
    d_final = jnp.zeros(_state_shape(st, b).shape, F32)
  elif seg is not None:
    d_final = seg.with_zero_slot(d_final)
  if seg is not None:
    d_out = seg.layout.to_aligned(d_out)
  inputs += [
      common.Operand("states", states, block=_residual_block(st, rev, st.dim_k, st.dim_v)),
      common.Operand("tmats", tmats, block=_residual_block(st, rev, chunk, chunk)),
      common.Operand("d_out", _flat(d_out), block=_token_block(st, rev, st.hv * st.dim_v)),
  ]
  if d_final is not None:
    inputs.append(common.Operand("d_final", d_final.astype(F32), block=state_spec))
  if st.guard:
    inputs.append(_guard_fwd_operand(st, b, rev, residuals[2]))
  hk = q.shape[2]
  grad_names = ("dq", "dk", "dv", "d_gate", "dbeta", "d_h0") + (
      ("d_a_log", "d_dt_bias") if st.gate_act else ())
  flat_shape = lambda x: jax.ShapeDtypeStruct(_flat(x).shape, x.dtype)
  outputs = [
      common.Operand("dq", block=_token_block(st, rev, hk * st.dim_k), shape=flat_shape(q)),
      common.Operand("dk", block=_token_block(st, rev, hk * st.dim_k), shape=flat_shape(k)),
      common.Operand("dv", block=_token_block(st, rev, st.hv * st.dim_v), shape=flat_shape(v)),
      common.Operand("d_gate", block=_token_block(st, rev, st.hv),
               shape=jax.ShapeDtypeStruct((b, t, st.hv), log_decay.dtype)),
      common.Operand("dbeta", block=_token_block(st, rev, st.hv),
               shape=jax.ShapeDtypeStruct((b, t, st.hv), beta.dtype)),
  ]
  if initial_state is not None:
    outputs.append(common.Operand("d_h0", block=state_spec, shape=_state_shape(st, b)))
  if st.gate_act:
    # Resident over the chunks: the kernel accumulates into them.
    outputs += [common.Operand(name, block=block((None, 1, st.hv), "b", 0, 0),
                         shape=jax.ShapeDtypeStruct((b, 1, st.hv), F32))
                for name in ("d_a_log", "d_dt_bias")]
  scratch = ([common.Operand("ds", shape=pltpu.VMEM((st.hv, st.dim_k, st.dim_v), F32))]
             + head_scratch(st, ("vh", "doh") if st.bwd_copies else (), q=st.bwd_copies,
                            k=st.bwd_copies)
             + [common.Operand("dg_rows", shape=pltpu.VMEM((st.hv, chunk), F32)),
                common.Operand("db_rows", shape=pltpu.VMEM((st.hv, chunk), F32))]
             + _guard_scratch(st, 2))
  res = pallas_call(
      bwd_kernel.bwd_kernel, st, None if seg is None else dict(code=seg.code), grid=(b, nc),
      inputs=inputs, outputs=outputs, scratch=scratch, vmem_limit_bytes=vmem_limit_bytes, interpret=interpret, name="gdn_bwd")
  for n, x in (("dq", q), ("dk", k), ("dv", v)):
    res[n] = res[n].reshape(x.shape)
  grads = tuple(res.get(n) for n in grad_names)
  if seg is None:
    return grads
  per_token = [seg.layout.from_aligned(res[n]) for n in grad_names[:5]]
  assert per_token[0].shape[1] == t_in
  d_h0 = None if initial_state is None else seg.per_segment(res["d_h0"])
  return (*per_token, d_h0) + grads[6:]
