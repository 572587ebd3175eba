"""Serving GDN (causal conv1d + gated delta rule on state pools): the Op every
implementation derives from. Calling convention and semantics: tokamax 0.0.17's
`causal_conv1d_gated_delta_rule` (DESIGN.md, "Serving op contract").

Per valid request r (r < mixed_end = distribution[2], clamped to R requests),
owning tokens [qsl[r], qsl[r+1]) (len_r of them) and, per token t, with
xp = [conv state (W-1 rows); the request's raw qkv rows]:

  pre_t = conv_bias + sum_w conv_weight[:, 0, w] * xp[t + w];   x_t = silu(pre_t)
  q_t, k_t, v_t = split(x_t);  q, k L2-normalised (eps 1e-6), value head h
                                reads key head h // (n_v / n_kq)
  beta_t = sigmoid(b_t);  g_t = -exp(a_log) * softplus(a_t + dt_bias)
  S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - k_t^T S_t)^T;  o_t = d_k^-1/2 S_t^T q_t

Both states (conv: the last W-1 raw inputs; recurrent: S) start from slot
read_r = read_state_indices[r] + read_offsets[r] (defaults: state_indices[r],
0) when seq_lens[r] > len_r (the request continues earlier tokens), else from
zeros. Writes, into the pools' dtype (everything inside a call is float32):
- requests r < decode_end = distribution[0] (decodes; speculative verify
  windows when num_spec_tokens = s > 0) write m = min(len_r, s + 1)
  checkpoints: slot state_indices[r] + j gets the state after token
  len_r - m + j (so with len_r <= s + 1, the state after token j);
- the other valid requests (prefills, continuations) write their final state
  to slot state_indices[r].
Nothing else is written: a slot no valid request writes is bit-identical
after the call (the null slot 0 of padding requests included), and the `out`
rows of tokens outside valid requests are zero. A NaN or inf in one request's
tokens or read slot reaches no other request's outputs or slots.

Preconditions the op cannot check on traced values (checked when the index
arrays are concrete): `distribution` is non-negative and non-decreasing;
decode-segment requests have 1 <= len_r <= s + 1 (the `xla` and Pallas
paths process s + 1 tokens per decode request); valid requests' token ranges
are in order inside [0, tokens); the slots they read and write are in
[0, slots), no two write the same slot, and none reads a slot another one
writes (implementations may order the requests' reads and writes
differently).

Split of work: `bind` validates and canonicalises once for every backend;
`_fwd` builds the per-request metadata (`Requests`) and calls the backend's
`_serve`. Forward only (no VJP).
"""

import dataclasses
import functools
from typing import Any, ClassVar, TypeAlias

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int  # pylint: disable=g-multiple-import,g-importing-member
import numpy as np
from tokamax._src.ops import op

from tokamax_gdn.autotuning import ShippedAutotuningCacheMixin
from tokamax_gdn.ops import checks
from tokamax_gdn.ops.gated_delta_rule import prologue as gdn_prologue

AbstractArray = jax.ShapeDtypeStruct | jax.core.ShapedArray
# ((new_conv_state, new_recurrent_state), out)
Output: TypeAlias = tuple[tuple[jax.Array, jax.Array], jax.Array]


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["start", "length", "valid", "decode", "has_init", "read_slot",
                 "write_slot", "num_checkpoints", "valid_tokens_end", "bad", "index"],
    meta_fields=["window"])
@dataclasses.dataclass(frozen=True)
class Requests:
  """Per-request metadata every backend reads ([R] int32 / bool).

  start, length: the request's tokens [start, start + length) (0 for invalid
    requests).
  valid: r < mixed_end and length > 0 (the request reads and writes states).
  decode: valid and r < decode_end (checkpointed; at most `window` tokens).
  has_init: starts from the read slot's states (else zeros).
  read_slot: read_state_indices + read_offsets, clipped into the pool.
  write_slot: state_indices (first checkpoint slot for decode requests).
  num_checkpoints: states written: min(length, window) for decode requests,
    1 for the other valid ones, 0 for invalid ones.
  valid_tokens_end: scalar, qsl[mixed_end]: `out` rows from there on are zero.
  bad: r < mixed_end, length > 0, and a slot it would write (its window's for
    a decode) or the slot it would read lies outside the pool: such a request
    is not valid (it reads and writes nothing) and its output rows are NaN.
    Checked eagerly too (a ValueError with concrete indices); under jit this
    is what keeps every other slot intact.
  index: the call's index arrays as int32 (`Index`), for a backend that
    derives the fields above itself (the Pallas decode kernel does, from
    SMEM, so that they cost no XLA ops; XLA drops the fields nothing reads).
  window: num_spec_tokens + 1 (static).
  """

  start: jax.Array
  length: jax.Array
  valid: jax.Array
  decode: jax.Array
  has_init: jax.Array
  read_slot: jax.Array
  write_slot: jax.Array
  num_checkpoints: jax.Array
  valid_tokens_end: jax.Array
  bad: jax.Array
  index: "Index"
  window: int

  @classmethod
  def build(cls, query_start_loc, state_indices, distribution, seq_lens,
            read_state_indices, read_offsets, *, num_slots: int, window: int) -> "Requests":
    r = state_indices.shape[0]
    qsl = query_start_loc.astype(jnp.int32)
    dist = distribution.astype(jnp.int32)
    # tokamax clamps mixed_end to the request count (its tests pass [0, 3, 3]
    # with one request) and decode_end to mixed_end.
    num_valid = jnp.clip(dist[2], 0, r)
    num_decode = jnp.clip(dist[0], 0, num_valid)
    idx = jnp.arange(r, dtype=jnp.int32)
    in_range = idx < num_valid
    length = jnp.where(in_range, qsl[1:] - qsl[:-1], 0)
    reads = state_indices if read_state_indices is None else read_state_indices
    read_slot = reads.astype(jnp.int32)
    if read_offsets is not None:
      read_slot = read_slot + read_offsets.astype(jnp.int32)
    write_slot = state_indices.astype(jnp.int32)
    runs = in_range & (length > 0)
    writes = jnp.where(runs & (idx < num_decode), jnp.minimum(length, window), 1)
    reads_state = seq_lens.astype(jnp.int32) > length
    outside = ((write_slot < 0) | (write_slot + writes > num_slots)
               | (reads_state & ((read_slot < 0) | (read_slot >= num_slots))))
    bad = runs & outside
    valid = runs & ~bad
    decode = valid & (idx < num_decode)
    length = jnp.where(valid, length, 0)
    start = jnp.where(valid, qsl[:-1], 0)
    has_init = valid & reads_state
    read_slot = jnp.clip(read_slot, 0, num_slots - 1)
    num_checkpoints = jnp.where(decode, jnp.minimum(length, window), valid.astype(jnp.int32))
    as_i32 = lambda x: None if x is None else x.astype(jnp.int32)
    index = Index(query_start_loc=qsl, state_indices=write_slot, distribution=dist,
                  seq_lens=seq_lens.astype(jnp.int32),
                  read_state_indices=as_i32(read_state_indices),
                  read_offsets=as_i32(read_offsets))
    return cls(start=start, length=length, valid=valid, decode=decode, has_init=has_init,
               read_slot=read_slot, write_slot=write_slot, num_checkpoints=num_checkpoints,
               valid_tokens_end=qsl[num_valid], bad=bad, index=index, window=window)

  def bad_tokens(self, num_tokens: int) -> jax.Array:
    """[T] bool: the tokens of `bad` requests (their output rows are NaN)."""
    qsl = self.index.query_start_loc
    token = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    return jnp.any(self.bad[None, :] & (token >= qsl[None, :-1]) & (token < qsl[None, 1:]),
                   axis=1)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["query_start_loc", "state_indices", "distribution", "seq_lens",
                 "read_state_indices", "read_offsets"],
    meta_fields=[])
@dataclasses.dataclass(frozen=True)
class Index:
  """The index arrays of a call, int32, as passed (`bind`'s names and shapes;
  the optional ones None when not given). `Requests` holds what they mean."""

  query_start_loc: jax.Array
  state_indices: jax.Array
  distribution: jax.Array
  seq_lens: jax.Array
  read_state_indices: jax.Array | None
  read_offsets: jax.Array | None


@dataclasses.dataclass(frozen=True)
class Dims:
  """Static sizes of a call.

  scale_d_k: the d_k that sets the query scale, where it is not `d_k` (0):
  a backend that pads the heads to more lanes keeps the caller's scale.
  """

  n_kq: int
  n_v: int
  d_k: int
  d_v: int
  kernel_size: int
  scale_d_k: int = 0

  @property
  def key_dim(self) -> int:
    return self.n_kq * self.d_k

  @property
  def dim(self) -> int:
    return 2 * self.n_kq * self.d_k + self.n_v * self.d_v

  @property
  def scale(self) -> float:
    return (self.scale_d_k or self.d_k)**-0.5


def split_heads(x: jax.Array, dims: Dims):
  """Post-conv activations [..., dim] -> q, k [..., n_kq, d_k], v [..., n_v, d_v]."""
  lead = x.shape[:-1]
  kd = dims.key_dim
  q = x[..., :kd].reshape(*lead, dims.n_kq, dims.d_k)
  k = x[..., kd:2 * kd].reshape(*lead, dims.n_kq, dims.d_k)
  v = x[..., 2 * kd:].reshape(*lead, dims.n_v, dims.d_v)
  return q, k, v


def gates(b: jax.Array, a: jax.Array, a_log: jax.Array, dt_bias: jax.Array):
  """(beta, log-decay g), float32: sigmoid(b), -exp(a_log) softplus(a + dt_bias)."""
  beta = jax.nn.sigmoid(b.astype(jnp.float32))
  return beta, gdn_prologue.gate_log_decay(a, a_log, dt_bias)


def conv_weight_taps(conv_weight: jax.Array) -> jax.Array:
  """[dim, 1, W] -> float32 [W, dim] (tap w multiplies the input W-1-w back)."""
  return jnp.transpose(conv_weight[:, 0, :]).astype(jnp.float32)


def _concrete(x) -> np.ndarray | None:
  if x is None or isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct, jax.core.ShapedArray)):
    return None
  try:
    return np.asarray(x)
  except Exception:  # pylint: disable=broad-except
    return None


def _require_int_vector(name: str, x, length: int, what: str) -> None:
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{checks.describe(name, x)} must be an integer array.")
  checks.require_shape(name, x, (length,), what)


def check_concrete_metadata(qsl, state_indices, distribution, seq_lens, read_state_indices,
                            read_offsets, *, num_tokens: int, num_slots: int, window: int) -> None:
  """The preconditions of the module docstring, when the index arrays are concrete."""
  arrays = [_concrete(x) for x in (qsl, state_indices, distribution, seq_lens)]
  if any(a is None for a in arrays):
    return
  qsl, slots, dist, seq_lens = (a.astype(np.int64) for a in arrays)
  r = slots.shape[0]
  # A decreasing or negative distribution is a caller bug that the clamps
  # below would otherwise turn into a silently different batch (mixed_end
  # past R stays allowed: tokamax's own tests pass [0, 0, 3] with R = 1).
  if dist.min() < 0 or not dist[0] <= dist[1] <= dist[2]:
    raise ValueError(
        f"`distribution` {dist.tolist()}: expected [decode_end, prefill_end, mixed_end],"
        " non-negative and non-decreasing.")
  n_valid = int(np.clip(dist[2], 0, r))
  n_decode = int(np.clip(dist[0], 0, n_valid))
  starts = qsl[:n_valid + 1]
  if n_valid and (np.any(np.diff(starts) < 0) or starts[0] < 0 or starts[-1] > num_tokens):
    raise ValueError(
        f"`query_start_loc` {qsl[:n_valid + 1].tolist()}: the first mixed_end + 1 ="
        f" {n_valid + 1} entries must be non-decreasing within [0, {num_tokens}] (tokens).")
  lengths = np.diff(starts)
  if n_decode and np.any(lengths[:n_decode] > window):
    raise ValueError(
        f"`query_start_loc`: decode requests (the first decode_end = {n_decode}) hold at most"
        f" num_spec_tokens + 1 = {window} tokens each; got lengths"
        f" {lengths[:n_decode].tolist()}.")
  idx, live = np.arange(n_valid), lengths > 0
  decode = live & (idx < n_decode)
  own = {int(i): (list(range(slots[i], slots[i] + lengths[i])) if decode[i] else [slots[i]])
         for i in idx[live]}
  writes = np.array([w for ws in own.values() for w in ws], np.int64)
  if writes.size and (writes.min() < 0 or writes.max() >= num_slots):
    raise ValueError(
        f"`state_indices` {slots[:n_valid].tolist()}: valid requests write slots outside"
        f" [0, {num_slots}) (a decode request writes one slot per token from its own).")
  if np.unique(writes).size != writes.size:
    raise ValueError(
        f"`state_indices` {slots[:n_valid].tolist()}: two valid requests write the same slot.")
  reads = _concrete(read_state_indices)
  reads = slots if reads is None else reads.astype(np.int64)
  offs = _concrete(read_offsets)
  if offs is not None:
    reads = reads + offs.astype(np.int64)
  if n_valid and (reads[:n_valid][live].min(initial=0) < 0
                  or reads[:n_valid][live].max(initial=0) >= num_slots):
    raise ValueError(
        f"`read_state_indices` + `read_offsets` {reads[:n_valid].tolist()}: valid requests"
        f" read slots outside [0, {num_slots}).")
  all_writes = set(writes.tolist())
  for i in idx[live & (seq_lens[:n_valid] > lengths)]:
    slot = int(reads[i])
    if slot in all_writes and slot not in own[int(i)]:
      raise ValueError(
          f"`read_state_indices` / `read_offsets`: request {i} reads slot {slot}, which another"
          " request writes in the same call.")


class CausalConv1dGatedDeltaRule[C, K](ShippedAutotuningCacheMixin,
                                      op.Op[Any, Output, None, C, K]):
  """Serving GDN on state pools. Subclasses implement `_serve`."""

  # Pools of these dtypes only (tokamax's: bf16 and float32).
  pool_dtypes: ClassVar[tuple[Any, ...]] = (jnp.bfloat16, jnp.float32)
  # Whether `_serve`'s `out` is already zero on every token outside the valid
  # requests (then `_fwd` adds no select of its own).
  serve_zeroes_other_rows: ClassVar[bool] = False

  def bind(
      self,
      qkv: Float[Array | AbstractArray, "T D"],
      b: Float[Array | AbstractArray, "T Hv"],
      a: Float[Array | AbstractArray, "T Hv"],
      conv_state: Float[Array | AbstractArray, "S Wm1 D"],
      recurrent_state: Float[Array | AbstractArray, "S Hv K V"],
      conv_weight: Float[Array | AbstractArray, "D 1 W"],
      conv_bias: Float[Array | AbstractArray, "D"] | None,
      a_log: Float[Array | AbstractArray, "Hv"],
      dt_bias: Float[Array | AbstractArray, "Hv"],
      query_start_loc: Int[Array | AbstractArray, "R1"],
      state_indices: Int[Array | AbstractArray, "R"],
      distribution: Int[Array | AbstractArray, "3"],
      seq_lens: Int[Array | AbstractArray, "R"],
      read_state_indices: Int[Array | AbstractArray, "R"] | None = None,
      read_offsets: Int[Array | AbstractArray, "R"] | None = None,
      *,
      n_kq: int,
      n_v: int,
      d_k: int,
      d_v: int,
      kernel_size: int,
      num_spec_tokens: int = 0,
      return_residuals: bool = False,
  ) -> op.BoundArguments:
    """Checks shapes, dtypes and sizes once for every backend."""
    arrays = dict(qkv=qkv, b=b, a=a, conv_state=conv_state, recurrent_state=recurrent_state,
                  conv_weight=conv_weight, conv_bias=conv_bias, a_log=a_log, dt_bias=dt_bias,
                  query_start_loc=query_start_loc, state_indices=state_indices,
                  distribution=distribution, seq_lens=seq_lens,
                  read_state_indices=read_state_indices, read_offsets=read_offsets)
    for name, x in arrays.items():
      # A Python list or scalar would otherwise fail later with an
      # AttributeError that names no argument.
      if x is not None and not (hasattr(x, "shape") and hasattr(x, "dtype")):
        raise TypeError(f"`{name}` is a {type(x).__name__}: expected a jax or numpy array.")
    for name, val in (("n_kq", n_kq), ("n_v", n_v), ("d_k", d_k), ("d_v", d_v)):
      if int(val) != val or val < 1:
        raise ValueError(f"`{name}`={val!r}: expected a positive integer.")
    if n_v % n_kq:
      raise ValueError(f"`n_v`={n_v} must be a multiple of `n_kq`={n_kq} (GVA groups).")
    if int(kernel_size) != kernel_size or kernel_size < 2:
      raise ValueError(f"`kernel_size`={kernel_size!r}: expected an integer >= 2.")
    if int(num_spec_tokens) != num_spec_tokens or num_spec_tokens < 0:
      raise ValueError(f"`num_spec_tokens`={num_spec_tokens!r}: expected an integer >= 0.")
    dims = Dims(int(n_kq), int(n_v), int(d_k), int(d_v), int(kernel_size))
    checks.require_rank("qkv", qkv, 2, "[tokens, 2 n_kq d_k + n_v d_v]")
    checks.require_float("qkv", qkv)
    t = qkv.shape[0]
    checks.require_shape("qkv", qkv, (t, dims.dim),
                         f"[tokens, 2*n_kq*d_k + n_v*d_v = {dims.dim}]")
    for name, x in (("b", b), ("a", a)):
      checks.require_float(name, x)
      checks.require_shape(name, x, (t, n_v), "[tokens, n_v]")
    checks.require_rank("conv_state", conv_state, 3, "[slots, kernel_size - 1, dim]")
    checks.require_rank("recurrent_state", recurrent_state, 4, "[slots, n_v, d_k, d_v]")
    num_slots = recurrent_state.shape[0]
    for name, x in (("conv_state", conv_state), ("recurrent_state", recurrent_state)):
      checks.require_float(name, x)
      if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in self.pool_dtypes]:
        raise TypeError(f"{checks.describe(name, x)}: pools are bfloat16 or float32.")
    if num_slots < 1:
      raise ValueError(f"{checks.describe('recurrent_state', recurrent_state)}: no slots.")
    checks.require_shape("recurrent_state", recurrent_state, (num_slots, n_v, d_k, d_v),
                         "[slots, n_v, d_k, d_v]")
    checks.require_shape("conv_state", conv_state, (num_slots, kernel_size - 1, dims.dim),
                         "[slots (as recurrent_state), kernel_size - 1, dim]")
    checks.require_float("conv_weight", conv_weight)
    checks.require_shape("conv_weight", conv_weight, (dims.dim, 1, kernel_size),
                         "[dim, 1, kernel_size]")
    if conv_bias is not None:
      checks.require_float("conv_bias", conv_bias)
      checks.require_shape("conv_bias", conv_bias, (dims.dim,), "[dim]")
    for name, x in (("a_log", a_log), ("dt_bias", dt_bias)):
      checks.require_float(name, x)
      checks.require_shape(name, x, (n_v,), "[n_v]")
    r = state_indices.shape[0] if state_indices.ndim == 1 else -1
    if r < 1:
      raise ValueError(f"{checks.describe('state_indices', state_indices)}: expected [R],"
                       " R >= 1 (max requests).")
    _require_int_vector("state_indices", state_indices, r, "[R]")
    _require_int_vector("query_start_loc", query_start_loc, r + 1, "[R + 1]")
    _require_int_vector("distribution", distribution, 3, "[decode_end, prefill_end, mixed_end]")
    _require_int_vector("seq_lens", seq_lens, r, "[R]")
    if read_state_indices is not None:
      _require_int_vector("read_state_indices", read_state_indices, r, "[R]")
    if read_offsets is not None:
      _require_int_vector("read_offsets", read_offsets, r, "[R]")
    elif num_spec_tokens > 0:
      raise ValueError("`read_offsets` is required when `num_spec_tokens` > 0 (tokamax's"
                       " convention: the checkpoint each request resumes from).")
    check_concrete_metadata(query_start_loc, state_indices, distribution, seq_lens,
                            read_state_indices, read_offsets, num_tokens=t,
                            num_slots=num_slots, window=num_spec_tokens + 1)
    return super().bind(
        qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
        query_start_loc, state_indices, distribution, seq_lens, read_state_indices,
        read_offsets, n_kq=dims.n_kq, n_v=dims.n_v, d_k=dims.d_k, d_v=dims.d_v,
        kernel_size=dims.kernel_size, num_spec_tokens=int(num_spec_tokens),
        return_residuals=return_residuals)

  def _fwd(
      self,
      qkv: Float[Array, "T D"],
      b: Float[Array, "T Hv"],
      a: Float[Array, "T Hv"],
      conv_state: Float[Array, "S Wm1 D"],
      recurrent_state: Float[Array, "S Hv K V"],
      conv_weight: Float[Array, "D 1 W"],
      conv_bias: Float[Array, "D"] | None,
      a_log: Float[Array, "Hv"],
      dt_bias: Float[Array, "Hv"],
      query_start_loc: Int[Array, "R1"],
      state_indices: Int[Array, "R"],
      distribution: Int[Array, "3"],
      seq_lens: Int[Array, "R"],
      read_state_indices: Int[Array, "R"] | None,
      read_offsets: Int[Array, "R"] | None,
      *,
      n_kq: int,
      n_v: int,
      d_k: int,
      d_v: int,
      kernel_size: int,
      num_spec_tokens: int,
      return_residuals: bool,
      config: C,
  ) -> tuple[Output, None]:
    del return_residuals
    dims = Dims(n_kq, n_v, d_k, d_v, kernel_size)
    reqs = Requests.build(query_start_loc, state_indices, distribution, seq_lens,
                          read_state_indices, read_offsets,
                          num_slots=recurrent_state.shape[0], window=num_spec_tokens + 1)
    (conv_pool, rec_pool), out = self._serve(
        qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log, dt_bias,
        reqs, dims=dims, config=config)
    if not self.serve_zeroes_other_rows:
      token = jnp.arange(qkv.shape[0])
      out = jnp.where((token < reqs.valid_tokens_end)[:, None], out, 0)
    out = jnp.where(reqs.bad_tokens(qkv.shape[0])[:, None], jnp.nan, out).astype(qkv.dtype)
    return ((conv_pool.astype(conv_state.dtype), rec_pool.astype(recurrent_state.dtype)),
            out), None

  def _serve(self, qkv, b, a, conv_state, recurrent_state, conv_weight, conv_bias, a_log,
             dt_bias, reqs: Requests, *, dims: Dims, config: C) -> Output:
    """Returns ((conv pool, recurrent pool) in their dtypes, out [T, n_v d_v]).

    The arrays are `_fwd`'s (shapes in `bind`); `reqs` is the request
    metadata built from its `query_start_loc` ... `read_offsets`. Rows of
    `out` at or past `reqs.valid_tokens_end` may hold anything finite or not
    (`_fwd` zeroes them, unless `serve_zeroes_other_rows`); every other row
    and every slot follows the module docstring.
    """
    raise NotImplementedError
