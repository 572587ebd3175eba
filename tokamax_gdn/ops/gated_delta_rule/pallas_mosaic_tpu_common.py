"""What every Pallas GDN kernel shares: static config, named refs, head layout.

`Static` holds the compile-time facts of one kernel call; `Refs` and
`Operand` name the operands `pallas_call` builds; `lanes`, `load_heads` and
`store_heads` move heads between (C, H D) token blocks and head-major scratch;
the `code_*` helpers read the per-segment chunk codes; `v5e_forms()`,
`normalize_interleave` and `default_newton` pick the static config.
Algebra: `docs/gdn_math.md`; layout and v5e forms: `docs/gdn_pallas_tpu.md`.
"""

import dataclasses
import functools
import operator
from typing import Any

from jax import lax
from jax.experimental import pallas as pl
import jax.numpy as jnp

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import numerics
from tokamax_gdn.ops import segments

F32, BF16 = jnp.float32, jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Static:
  """Compile-time facts shared by the kernels."""

  t_len: int
  chunk: int
  hk: int
  hv: int
  dim_k: int
  dim_v: int
  scale: float
  passes: int
  newton: int
  interleave: int     # value heads per group: a multiple of the GVA group dividing Hv
  has_seg: bool
  has_h0: bool
  n_states: int = 0   # per-segment states (0: a [B, Hv, K, V] state or none)
  # The in-kernel half of `isolation.SegmentGuard` (its gates and states are
  # sanitised in XLA): non-finite k, v (and q, dO in the backward) count as 0.
  sanitize: bool = False
  # The whole `isolation.SegmentGuard` in the kernels (`_guard_*`; not with
  # per-segment states): the raw gates, betas and states come in too, the
  # per-token bad flags are taken from the tiles the kernel loads and carried
  # across the chunks, the tiles are sanitised (the forward's k, v where the
  # head groups read them, `guard.guard_finite`; the backward's in place in a
  # chunk with a bad token, `guard._guard_sanitize`), and the outputs,
  # the final state and the gradients of the poisoned tokens are made NaN in
  # VMEM.
  guard: bool = False
  # The op's prologue in the kernel (`prologue.prologue`, from the raw
  # inputs): q, k L2-normalised (`qk_l2norm`, `kernel_prologue.normed`); the log-decay
  # -exp(a_log) * softplus(g + dt_bias) of the raw gate (`gate_act`: a_log
  # and dt_bias are the `a_log` and `dt_bias` inputs: `kernel_prologue.gate_params`) and floored at
  # `log_decay_floor` (`kernel_prologue._log_decay`); beta the sigmoid of the beta input's
  # logits (`beta_sigmoid`, `kernel_prologue.beta_block`).
  qk_l2norm: bool = False
  gate_act: bool = False
  log_decay_floor: float | None = None
  beta_sigmoid: bool = False
  # The forward kernels' q, k normalised in place in the head-major scratch
  # before the head groups (tpu7x: less scoped VMEM), else where a head group
  # reads them (faster on v6e; in place, tpu7x's forward at T=32768 with an
  # initial state fits its scoped VMEM).
  qk_in_place: bool = False
  # The head groups unrolled (`run_groups`): all of them (True), or by this
  # factor. tpu7x: the backward by 2, the forward kernels not (all of them
  # took its forward to 21.08 of its 21 MiB scoped VMEM at Qwen3-Next heads,
  # T=4096, by 2 the context-parallel forward to 21.16).
  unroll_groups: bool | int = False
  interpret: bool = False   # traced for Pallas interpret mode (`transposed_tile`)
  # bf16 inputs: the backward's row sums of f ⊙ β (d_gcum's) as columns of
  # the tile it carries across head groups (`gates.lane_rowsums`: a 128-row
  # product per head), else as a row (`gates.rowsum_row`: 8 rows of β's
  # pieces against f pushed as weights). Columns were cheaper on v6e's
  # estimate, the row on v5e's and tpu7x's (`f_sums_as_columns`).
  f_cols: bool = False
  # The backward's q, k, v and dO: copied to head-major f32 scratch, the NaN
  # guard sanitising them there in place in a chunk with a bad token
  # (`guard._guard_sanitize`), or read from their blocks where the head
  # groups use them, the guard's selects there (`guard.guard_finite`). The
  # copies (a store per f32 vreg, on the store slot v5e's backward is short
  # of) cost v5e's and tpu7x's estimates more, the selects v6e's
  # (`bwd_head_copies`).
  bwd_copies: bool = True
  # The backward's dk terms of K Kᵀ, d_KK K + d_KKᵀ K, as one product of
  # d_KK + d_KKᵀ (a transpose on the XLU) or as two (d_KKᵀ K beside d_QKᵀ Q
  # in one transposed-operand product). One was cheaper on v5e's estimate,
  # whose MXU time follows the rows it streams, two on v6e's and tpu7x's
  # (`dk_symmetric`).
  dk_sym: bool = False
  # The residual T' of odd heads stored as the inverse gives it, T'ᵀ
  # (`tmat_transposed`), the backward taking it transposed, or every T'
  # stored as it is, the forward kernels transposing the odd ones. v5e's
  # estimate: the former cheaper for both passes; v6e's and tpu7x's: the
  # backward's products cost more with it (`paired_tmats`).
  paired_tmats: bool = False
  # The backward's WY part through V″ = T' (V − K_in S), the forward kernels'
  # form (`bwd_kernel._wy_through_vnew`: products of 128-deep contractions
  # only, 3 of ~17.5 per head fewer), or through [W̃ | Ũ] = T' [K_in | V]
  # (`bwd_kernel._wy_stacked`: stacked 256-deep contractions). v5e's 128×128
  # MXUs take the former (8 % fewer cycles on its estimate), the 256-deep
  # MXUs of v6e and tpu7x the latter (`bwd_through_vnew`).
  bwd_vnew: bool = False
  # `requests.gdn_fwd_requests`: q, k, v are lane ranges of one [T, 2 Hk K + Hv V]
  # input and the output is [B, T, Hv V] (heads are lane slices of a block: no
  # relayout); `beta_guard`: k and v read as 0 at tokens whose beta is 0
  # (`kernel_prologue.packed_heads`).
  packed: bool = False
  beta_guard: bool = False
  # `requests`: grid steps are work items (a block and a request touching
  # it) described in SMEM; `gated`: items whose run flag is 0 do nothing
  # (the cost model `all_run` compiles every item ungated).
  requests: bool = False
  gated: bool = False
  # Traced for v5e: the forms libtpu's cycle estimator accepts there (module
  # docstring); the values are the same up to ties in rounding to bf16.
  v5e_forms: bool = False

  @property
  def group(self) -> int:
    return self.hv // self.hk

  @property
  def mm(self):
    return BF16 if self.passes == 1 else F32

  @property
  def tail(self) -> bool:
    # With `requests` a block's rows past T are outside every item's rows.
    return not self.requests and self.t_len % self.chunk != 0


class Refs:
  """A kernel's refs by name: the scalar-prefetched chunk codes, then the
  inputs, outputs and scratch buffers as `call.pallas_call` passes them.

  `call.pallas_call` names every operand where it builds the operand lists (`Operand`),
  and the kernel reads them back here by those names, so the order of the
  refs is stated once and cannot drift from the builder. A name the call
  did not pass reads as None (an optional operand: `starts` without
  segments, `h0` without an initial state, ...).
  """

  def __init__(self, names: tuple[str, ...], refs):
    assert len(names) == len(refs), (names, len(refs))
    self._refs = dict(zip(names, refs))

  def __getattr__(self, name):
    if name.startswith("_"):
      raise AttributeError(name)
    return self._refs.get(name)


@dataclasses.dataclass(frozen=True)
class Operand:
  """One named operand of `call.pallas_call`: an input (`array`, `block`), an output
  (`block`, `shape`: a ShapeDtypeStruct) or a scratch buffer (`shape`: its
  VMEM type)."""

  name: str
  array: Any = None
  block: Any = None
  shape: Any = None


def lanes(ref, start, width: int, st: Static, c_idx):
  """Lanes [start, start + width) of a (C, ·) token block in f32, an aligned
  slice (no relayout); rows at or past T zeroed. `start` may be traced (a
  head group's index in a loop), a multiple of `width`."""
  return tail_mask(ref[:, _lane_slice(start, width)].astype(F32), st, c_idx)


def _lane_slice(start, width: int):
  if isinstance(start, int):
    return slice(start, start + width)
  return pl.ds(pl.multiple_of(start, width), width)


def load_heads(ref, scr, st: Static, c_idx):
  """A (C, H D) block's heads into the head-major f32 scratch `scr` (H, C, D)
  (`call._token_block`)."""
  d = scr.shape[-1]
  for j in range(scr.shape[0]):
    scr[j] = lanes(ref, j * d, d, st, c_idx)


class BlockHeads:
  """The heads of a (C, H D) token block as `load_heads` would put them in
  scratch, read from the block where they are used: `heads[j]` is head j
  (C, D) f32, rows at or past T zeroed; `heads[j] = x` writes head j (C, D)
  in the block's dtype (`store_heads` without the scratch). j may be
  traced."""

  def __init__(self, ref, d: int, st: Static, c_idx):
    self._ref, self._d, self._st, self._c_idx = ref, d, st, c_idx

  def __getitem__(self, j):
    return lanes(self._ref, j * self._d, self._d, self._st, self._c_idx)

  def __setitem__(self, j, x):
    x = x.astype(self._ref.dtype)
    if isinstance(j, int) or lanes_of_heads(self._d):
      self._ref[:, _lane_slice(j * self._d, self._d)] = x
      return
    # A traced head index at D under 128 lanes: Mosaic cannot prove such a
    # store's lane offset aligned (tpu7x's backward at D = 32 failed to
    # compile), so the store picks its head's static slice.
    for h in range(self._ref.shape[-1] // self._d):
      @pl.when(j == h)
      def _(h=h):
        self._ref[:, h * self._d:(h + 1) * self._d] = x


def head_tiles(ref, scr, d: int, st: Static, c_idx):
  """The heads of a (C, H D) token block as the head groups index them: copied
  into the head-major f32 scratch `scr` (`load_heads`) where the kernel has
  that scratch, else read from the block where they are used (`BlockHeads`,
  `scr` None)."""
  if scr is None:
    return BlockHeads(ref, d, st, c_idx)
  load_heads(ref, scr, st, c_idx)
  return scr


def head_copies(st: Static, write_out: bool) -> tuple[bool, bool, bool]:
  """Whether a forward kernel keeps q, k and v in the head-major f32 scratch
  "qh", "kh", "vh": where the packed input fills them (`packed`), q and k
  where they are normalised in place (`qk_in_place`, a loop over the
  heads), and heads narrower than 128 lanes (`lanes_of_heads`). Otherwise
  the head groups read them from their blocks (`BlockHeads`): a copy costs
  a store per f32 vreg (and its load back), on the store slot v5e's
  forward kernels are short of, and the NaN guard sanitises them by selects
  where the head groups read them (`guard.guard_finite`), not in place. The
  states pass (no outputs) reads no q."""
  k_copy = st.packed or st.qk_in_place or not lanes_of_heads(st.dim_k)
  return ((write_out and k_copy) or st.packed, k_copy,
          st.packed or not lanes_of_heads(st.dim_v))


def lanes_of_heads(dim: int) -> bool:
  """Whether heads of `dim` are whole lane tiles of a (C, H D) block, so that
  `BlockHeads` can read one at a head index the head groups' loop traces
  (Mosaic cannot prove a narrower head's lane offset aligned: tpu7x's
  training step at a head dim under 128, its forward's head groups in a
  loop, failed to compile)."""
  return dim % 128 == 0


def store_heads(scr, ref, rows=None):
  """The head-major f32 scratch `scr` (H, C, D) into a (C, H D) block as
  lane slices, in the block's dtype; with `rows` (lo, hi) only those rows
  (the others keep the block's values: `requests.gdn_fwd_requests`' items)."""
  d = scr.shape[-1]
  for j in range(scr.shape[0]):
    lanes = slice(j * d, (j + 1) * d)
    if rows is None:
      ref[:, lanes] = scr[j].astype(ref.dtype)
    else:
      row = lax.broadcasted_iota(jnp.int32, scr.shape[1:], 0)
      ref[:, lanes] = jnp.where((row >= rows[0]) & (row < rows[1]),
                                scr[j].astype(ref.dtype), ref[:, lanes])


def tail_mask(x, st: Static, c_idx):
  """Zero the rows of tokens at or past T (a partial last block holds garbage)."""
  if not st.tail:
    return x
  pos = c_idx * st.chunk + lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 2)
  return jnp.where(pos < st.t_len, x, 0.0)


def row_mask(x, rows):
  """Zero the rows of x (C, ...) outside [lo, hi) of `rows` = (lo, hi) (None:
  none): the tokens of a work item's block that are not its request's
  (`requests.gdn_fwd_requests`); with beta and log-decay 0 they pass the state
  through."""
  if rows is None:
    return x
  row = lax.broadcasted_iota(jnp.int32, x.shape, 0)
  return jnp.where((row >= rows[0]) & (row < rows[1]), x, 0.0)


def finite(x, st: Static):
  """x with NaN / inf as 0 under `st.sanitize` (one head's tile: a select over
  a whole block costs scoped VMEM)."""
  return numerics.lhs_masked(jnp.isfinite(x), x, st.v5e_forms) if st.sanitize else x


def operand_cat(parts, axis, st: Static):
  """A matmul operand concatenated from f32 parts: cast to the operand dtype
  part by part, or (v5e forms) concatenated in f32 and cast by `numerics.mxu`."""
  if st.v5e_forms:
    return jnp.concatenate(parts, axis)
  return jnp.concatenate([p.astype(st.mm) for p in parts], axis)


def transposed_tile(x, st: Static):
  """xᵀ (C×C f32). In interpret mode as products with the identity, exact
  (x's three bf16 pieces): XLA:CPU folds a transpose stored as a residual
  into the backward's transposed-operand product of it, and then cannot run
  that product in bf16 ("Unsupported element type for DotThunk::Execute:
  BF16 x BF16 = F32")."""
  if not st.interpret:
    return x.T
  c = x.shape[0]
  eye = (lax.broadcasted_iota(jnp.int32, (c, c), 0)
         == lax.broadcasted_iota(jnp.int32, (c, c), 1)).astype(BF16)
  return functools.reduce(operator.add, [numerics.mm(eye, piece, tb=True)
                                         for piece in numerics.split_bf16(x, 3, st.v5e_forms)])


def residual(x, ref, st: Static):
  """x cast for a residual output `ref`. v5e forms: cast from a value of its
  own (x + 0), not the cast a matmul reads in another tiling."""
  return (x + 0.0 if st.v5e_forms else x).astype(ref.dtype)


def tmat_transposed(st: Static, head: int) -> bool:
  """Whether the residual T' of value head `head` (of a head group) is stored
  transposed, T'ᵀ, as `inverse.invert_unit_lower` gives every odd matrix of
  its list (the second of a pair), under `Static.paired_tmats`: with an
  even GVA group every head group has an even number of heads, so the
  forward kernels' lists pair heads 2m, 2m+1 and the parity of `head` is
  that of its index in the chunk. The backward takes it as stored
  (`numerics.mxu(ta=...)`), so no pass transposes it. An odd group: every
  T' stored as it is."""
  return st.paired_tmats and st.group % 2 == 0 and head % 2 == 1


def stored_tmat(t, transposed: bool, ref, st: Static, head: int):
  """T' of value head `head` for its residual output `ref`, from
  `inverse.invert_unit_lower`'s (t, transposed) pair: t as it is where
  `tmat_transposed` says so (t is T'ᵀ there), else transposed where t is
  T'ᵀ. On TPU (but v5e forms) the transpose is taken after the cast, in the
  stored dtype (bf16 for bf16 inputs: half the vregs through the XLU)."""
  if transposed == tmat_transposed(st, head):
    return residual(t, ref, st)
  if st.v5e_forms or st.interpret:
    return residual(transposed_tile(t, st), ref, st)
  return t.astype(ref.dtype).T


def head_row(rows_scr, kind, i):
  return rows_scr[kind, pl.ds(i, 1), :]


def group_heads(st: Static, gi):
  """(value heads u -> index, key heads ku -> index) of head group `gi`."""
  kpg = st.interleave // st.group
  return ({u: gi * st.interleave + u for u in range(st.interleave)},
          {ku: gi * kpg + ku for ku in range(kpg)})


def run_groups(st: Static, group, init=0):
  """`group(gi, carry)` for every head group, unrolled under
  `st.unroll_groups`: then one basic block, so
  the scheduler overlaps one group's transposes and broadcasts (XLU) with
  another's matmul chains (the inverse, which has none to hide): cheaper on
  the v6e and v5e estimates for all three kernels, and tpu7x's backward
  unrolled by 2. Returns the carry (`init` to start)."""
  return lax.fori_loop(0, st.hv // st.interleave, group, init, unroll=st.unroll_groups)


def flag(flags, bit: int):
  return (lax.shift_right_logical(flags, jnp.int32(bit)) & 1) == 1


# Per-segment states: one int32 code per chunk, read from SMEM (scalar
# prefetch) by the kernels and by the index maps of the state blocks.
def code_slot(code):
  """The state slot of the chunk's segment: min(segment, N); slot N is zeros."""
  return lax.shift_right_logical(code, jnp.int32(2))


def code_reset(code):
  """1 where a segment starts at the chunk: the state entering it is its slot's."""
  return lax.shift_right_logical(code, jnp.int32(1)) & 1


def code_last(code):
  """1 where the chunk is its segment's last: the state leaving it is its slot's."""
  return code & 1


def normalize_interleave(requested: int, hv: int, group: int) -> int:
  """The largest multiple of the GVA group dividing Hv, at most `requested`
  (at least one group)."""
  ok = [n for n in range(group, hv + 1, group) if hv % n == 0]
  return max([n for n in ok if n <= requested] or [ok[0]])


def v5e_forms() -> bool:
  """Whether the kernels are traced for v5e (`Static.v5e_forms`)."""
  return gdn_config.target_generation().name == "v5e"


# A kernel call of at most this many grid steps (batch rows x chunks: short
# sequences, as `validate` and the conformance suite run them) runs its head
# groups in a loop of at most `SMALL_GRID_INTERLEAVE` heads, not unrolled
# (`group_interleave`, `unroll_groups`). Unrolled, a grid step is one basic
# block of every head's code, which Mosaic compiles in time growing faster
# than the block; it saves a few microseconds a grid step, which only a long
# grid repays (pallas_mosaic_tpu.md, "Compile time"). (`tokamax-gdn aot`
# takes its cycle estimates at T = 512, 4 steps at C = 128 and B = 1: the
# long grids' form it extrapolates to T.)
SMALL_GRID_STEPS = 2
SMALL_GRID_INTERLEAVE = 4


def small_grid(steps: int | None) -> bool:
  """Whether a call of `steps` grid steps takes the small grids' form (None:
  unknown, no)."""
  return steps is not None and steps <= SMALL_GRID_STEPS


def group_interleave(requested: int, hv: int, group: int, steps: int | None = None) -> int:
  """`Static.interleave`: `normalize_interleave` of the request, at most
  `SMALL_GRID_INTERLEAVE` on a small grid (`small_grid`)."""
  if small_grid(steps):
    requested = min(requested, SMALL_GRID_INTERLEAVE)
  return normalize_interleave(requested, hv, group)


def unroll_groups(backward: bool = False, steps: int | None = None) -> bool | int:
  """How the head groups are unrolled (`Static.unroll_groups`): not on a
  small grid of `steps` grid steps (`small_grid`)."""
  if small_grid(steps):
    return False
  if gdn_config.target_generation().name != "tpu7x":
    return True
  return 2 if backward else False


def paired_tmats() -> bool:
  """`Static.paired_tmats` for the target generation."""
  return gdn_config.target_generation().name == "v5e"


def bwd_through_vnew() -> bool:
  """`Static.bwd_vnew` for the target generation."""
  return gdn_config.target_generation().name == "v5e"


def dk_symmetric() -> bool:
  """`Static.dk_sym` for the target generation."""
  return gdn_config.target_generation().name == "v5e"


def bwd_head_copies(st: Static) -> bool:
  """`Static.bwd_copies` for the target generation (always for heads
  narrower than 128 lanes: `lanes_of_heads`)."""
  return (gdn_config.target_generation().name == "v6e"
          or not (lanes_of_heads(st.dim_k) and lanes_of_heads(st.dim_v)))


def f_sums_as_columns() -> bool:
  """`Static.f_cols` for the target generation."""
  return gdn_config.target_generation().name == "v6e"


def default_newton(passes: int) -> int:
  """Newton steps of the inverse (`inverse.invert_unit_lower`): none for bf16 inputs
  (its start is as close as one step with a in bf16 gets), two for float32."""
  return 0 if passes == 1 else 2
