"""Pallas Mosaic TPU gated delta rule: Op wrapper (config, heuristics, VMEM, VJP).

The kernels live in `pallas_mosaic_tpu_*.py`, one module per concept (their TPU-specific design
in `docs/gdn_pallas_tpu.md`; the math in `docs/gdn_math.md`).

Rows shorter than a chunk (B > 1, T < C: short sequences, a batch of short
documents) run as one row of B·T tokens with a segment per row
(`batch_fold`) wherever no state crosses the call: about B·T / C chunks
instead of B, each mostly padding.

The shared prologue (q/k L2-norm, gate activation -exp(a_log)·softplus(g+dt_bias),
the -30 floor) runs inside the kernels (`prologue_in_core`, `kernel.Prologue`):
they read the raw q, k and gate, and the backward kernel does the prologue's
VJP, returning the raw inputs' gradients and per-token terms of a_log's,
which the wrapper sums. (In XLA, before the kernels and differentiated by
autodiff, it was a large share of the forward and of the step.) The in-chunk gate cumsum, decay masks, segment resets, the partial
last chunk and d log-decay per token are inside the kernels too.

The NaN guard (`isolation.SegmentGuard`) runs in the kernels
(`whole_guard_in_core`, `pallas_mosaic_tpu_guard.py`): they read the raw inputs, states
and cotangents, take each token's bad flags from the head tiles they load (row
sums of x·0 on the MXU), carry the running flag along the sequential chunk
axis (reset at segment starts), zero the non-finite values in VMEM (the
forward by a select where its head groups read a tile, `guard_finite`, the
backward in a chunk that has one, `_guard_sanitize`) and write NaN into the poisoned
tokens' outputs, final state and gradients; the states pass hands the backward
the forward's flags ([B, NC, Hv, C] f32), and the backward carries the "bad
cotangent at or after" flag in reverse. In XLA, as reductions, selects and
cumulative flags over the raw inputs, the guard was a fifth of the
forward's cost; in the kernels it adds a few percent. With per-segment states
([B, N, Hv, K, V]) XLA still computes the flags (`guards_in_core`): the
forward kernel gets the poison rows and the backward kernels zero non-finite
q, k, v, dO in VMEM.

Residuals for the backward, per token and value head, beyond the op inputs
tokamax keeps anyway:
  - `save_states=False` (heuristic default): 0 bytes; the backward first
    reruns the forward kernel without outputs to get the state entering each
    chunk and the chunk's WY inverse T' (K·V/C + C elements per token and
    head, bf16 for bf16 inputs: 384 B at K=V=C=128, live only during the
    backward).
  - `save_states=True`: the forward emits those and they are kept from
    forward to backward (the backward skips its first pass).
"""

import dataclasses
import functools
from typing import Annotated, ClassVar, Literal, NamedTuple

import jax
import jax.numpy as jnp
import pydantic
from tokamax._src.ops import op

from tokamax_gdn import config as gdn_config
from tokamax_gdn.ops import config_hooks
from tokamax_gdn.ops import partitioning
from tokamax_gdn.ops import segments
from tokamax_gdn.ops.gated_delta_rule import base
from tokamax_gdn.ops.gated_delta_rule import batch_fold
from tokamax_gdn.ops.gated_delta_rule import prologue
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_kernel as kernel
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_vmem import check_vmem  # pylint: disable=g-importing-member
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_vmem import kernel_vmem_limit, vmem_cap  # pylint: disable=g-importing-member
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_vmem import vmem_estimate  # pylint: disable=g-importing-member



@pydantic.dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Config:
  """Tiling of the Mosaic TPU GDN kernels.

  chunk_size: tokens per chunk C (the WY block; the inverse costs O(C) per token).
  interleave: value heads whose stages run interleaved (each stage for all of
    them before the next): more hides more MXU latency but keeps more C×C
    tiles live in VMEM.
  save_states: keep the chunk-entry states and WY inverses from the forward
    (see the module docstring) instead of recomputing them in the backward.
  """

  chunk_size: Literal[64, 128, 256] = 128
  interleave: Annotated[int, pydantic.Field(gt=0)] = 16
  save_states: bool = False


class _Shapes(NamedTuple):
  hk: int
  hv: int
  dim_k: int
  dim_v: int
  itemsize: int
  length: int


def _shapes_of(q, v) -> _Shapes:
  return _Shapes(q.shape[-2], v.shape[-2], q.shape[-1], v.shape[-1],
                 jnp.dtype(q.dtype).itemsize, q.shape[1])


def _shapes(ba: op.BoundArguments) -> _Shapes:
  return _shapes_of(ba.arguments["query"], ba.arguments["value"])




def _run_interleave(interleave: int, sh: _Shapes) -> int:
  """The interleave the kernels run with (a multiple of the GVA group dividing Hv)."""
  return kernel.normalize_interleave(interleave, sh.hv, sh.hv // sh.hk)


def _estimate(cfg: Config, sh: _Shapes, kind: str) -> int:
  return vmem_estimate(chunk=cfg.chunk_size, hv=sh.hv, hk=sh.hk, dim_k=sh.dim_k,
                       dim_v=sh.dim_v, itemsize=sh.itemsize,
                       interleave=_run_interleave(cfg.interleave, sh), kernel=kind,
                       save_states=cfg.save_states, length=sh.length,
                       v5e_forms=common.v5e_forms())


def _fits(cfg: Config, sh: _Shapes, kind: str) -> bool:
  return _estimate(cfg, sh, kind) <= vmem_cap(gdn_config.target_generation())


def _most_interleaved(chunk: int, sh: _Shapes, kind: str, *, start: int = 16) -> Config:
  """C = `chunk` and the most heads interleaved (at most `start`) with which
  kernel `kind` fits (one GVA group if none does)."""
  ilv = start
  while True:
    cfg = Config(chunk_size=chunk, interleave=_run_interleave(ilv, sh))
    if ilv == 1 or _fits(cfg, sh, kind):
      return cfg
    ilv //= 2


def _kind(backward: bool) -> str:
  """The kernel a config is for: the forward Op's, or the VJP's backward kernel.

  The VJP's states pass (a forward without outputs) picks its own interleave,
  see `_states_config`, as it fits more heads (16 vs 4 on tpu7x).
  """
  return "bwd" if backward else "fwd"


def _heuristics(ba: op.BoundArguments, backward: bool) -> Config:
  """C = 128 and up to 16 heads interleaved (8 in the backward), as many as
  VMEM allows.

  In libtpu's static cycle estimate more heads interleaved are faster up to
  16 in the forward (not past it) and up to 8 in the backward (with its
  head groups unrolled into one basic block, 8 was faster than 16 on v5e
  and v6e: fewer live tiles for the scheduler to spill), and the backward
  at C=128 takes half the cycles of C=64:
  so C=128 with fewer heads first, C=64 only where C=128 does not fit with
  one GVA group (tpu7x's backward at T=4096). The numbers (per-kernel cycles
  of `tokamax-gdn aot` with the config fixed) are in docs/gdn_pallas_tpu.md,
  "Heuristics' measurements".
  """
  sh, kind, start = _shapes(ba), _kind(backward), 8 if backward else 16
  cfg = _most_interleaved(128, sh, kind, start=start)
  return cfg if _fits(cfg, sh, kind) else _most_interleaved(64, sh, kind, start=start)


# Autotuning explores configs estimated at most this fraction of the VMEM cap:
# on v5e the backward at C = 128 with 32 heads interleaved estimated 52.1 MiB
# (cap 53) and Mosaic needed 53.25, so the compile failed mid-sweep.
AUTOTUNE_VMEM_FRACTION = 31 / 32


def _autotuning_configs(ba: op.BoundArguments, backward: bool) -> set[Config]:
  sh, kind = _shapes(ba), _kind(backward)
  configs = {_heuristics(ba, backward)}
  cap = vmem_cap(gdn_config.target_generation()) * AUTOTUNE_VMEM_FRACTION
  for chunk in (64, 128, 256):
    for ilv in (2, 4, 8, 16, 32):
      for save in ((False,) if backward else (False, True)):
        cfg = Config(chunk_size=chunk, interleave=_run_interleave(ilv, sh), save_states=save)
        if _estimate(cfg, sh, kind) <= cap:
          configs.add(cfg)
  return configs


def _states_config(config: Config, sh: _Shapes) -> Config:
  """The VJP's states pass: the VJP's chunk size, its own interleave, up to
  32 heads (it holds no outputs; with every head group's inverse in one list
  one group of 32 was faster than two of 16; the forward gained nothing)."""
  return _most_interleaved(config.chunk_size, sh, "states", start=32)


def _folds(config: Config, q: jax.Array, v: jax.Array, kind: str, *, stateless: bool) -> bool:
  """Whether this (per-shard) kernel call runs its rows as one (`batch_fold`):
  `stateless` (no state in or out, no residuals kept), rows shorter than the
  chunk, and the config fits VMEM at the folded length."""
  b, t = q.shape[:2]
  return (stateless and batch_fold.folds(b, t, config.chunk_size)
          and _fits(config, _shapes_of(q, v)._replace(length=b * t), kind))


def _check_supported(q: jax.Array, v: jax.Array) -> bool:
  """Returns interpret mode; raises NotImplementedError where the kernels can't run."""
  interpret = gdn_config.require_pallas_tpu("gated_delta_rule")
  if q.dtype not in (jnp.float32, jnp.bfloat16):   # (`bind`: q, k and v share it)
    raise NotImplementedError(
        f"pallas_mosaic_tpu supports float32/bfloat16 q, k, v; got {q.dtype}.")
  if v.shape[2] > 128:
    raise NotImplementedError(f"pallas_mosaic_tpu supports up to 128 value heads; got {v.shape[2]}.")
  return interpret


def _kernel_args(config: Config, q: jax.Array, v: jax.Array, interpret: bool,
                 kind: str) -> dict:
  """Kernel keywords at these (per-device) shapes; every kernel gets the
  `vmem_cap` limit (less `AOT_SLACK` ahead of time), and a config past it (an explicit one: the heuristics
  never pick one) raises here, naming the shapes."""
  sh = _shapes_of(q, v)
  check_vmem("gated_delta_rule", _estimate(config, sh, kind),
             vmem_cap(gdn_config.target_generation()),
             f"the {kind} kernel at {config} for q {q.shape}, v {v.shape} {q.dtype}")
  return dict(chunk=config.chunk_size,
              interleave=_run_interleave(config.interleave, _shapes_of(q, v)),
              interpret=interpret,
              vmem_limit_bytes=kernel_vmem_limit(gdn_config.target_generation()))


def backward_config(ba: op.BoundArguments) -> Config:
  """The VJP's heuristic config (its backward kernel's) for these bound
  arguments of the forward Op, as the VJP picks it without an autotuning
  cache."""
  return _heuristics(ba, backward=True)


def states_pass_config(config: Config, ba: op.BoundArguments) -> Config:
  """The config of the VJP's states pass (a forward that writes the
  chunk-entry states, no outputs) when the VJP runs `config`."""
  return _states_config(config, _shapes(ba))


def kernel_keywords(config: Config, q: jax.Array, v: jax.Array, kind: str) -> dict:
  """The keywords the Op passes to kernel `kind` ("fwd", "states" or "bwd" of
  `pallas_mosaic_tpu_kernel`) for `config` at these shapes, interpret mode
  off: for tools that compile a kernel alone (`tokamax_gdn.aot`). Raises
  where the config's VMEM estimate is past the target's cap."""
  return _kernel_args(config, q, v, False, kind)


# Dimension labels of the kernels' operands (see `ops.partitioning`).
_LABELS = dict(
    q="b t h k", k="b t h k", v="b t hv v", log_decay="b t hv", g="b t hv", beta="b t hv",
    poison="b t hv", a_log="hv", dt_bias="hv",
    d_out="b t hv v", d_final="b hv k v", initial_state="b hv k v",
    states="b n hv kp vp", tmats="b n hv c1 c2", guard_flags="b n hv c1", segment_ids="b t",
)


_SEGMENT_STATES = "b n hv k v"   # per-segment initial / final states


def _state_label(initial_state) -> str:
  """The label of state-shaped operands: [B, Hv, K, V] or [B, N, Hv, K, V]."""
  per_segment = initial_state is not None and initial_state.ndim == 5
  return _SEGMENT_STATES if per_segment else _LABELS["d_final"]


def _per_shard(body, out_labels, hk: int, hv: int, arrays: dict):
  """body(**arrays) per batch/key-head shard under jit with sharded inputs."""
  labels = dict(_LABELS)
  labels["initial_state"] = labels["d_final"] = _state_label(arrays.get("initial_state"))
  return partitioning.call_per_shard(body, arrays, labels, out_labels,
                                     key_heads=hk, group=hv // hk)


class _KernelConfigs(config_hooks.PallasTpuHooks):
  """What the forward Op and its VJP share: the Config, its choice for the
  kernel each runs (the VJP's are `backward=True`), the log-decay floor, the
  devices."""

  op_name: ClassVar[str] = "gated_delta_rule"
  config_cls: ClassVar[type[Config]] = Config
  log_decay_floor: ClassVar[float | None] = prologue.CHUNKED_LOG_DECAY_FLOOR
  heuristics = functools.partial(_heuristics, backward=False)
  autotuning_configs = functools.partial(_autotuning_configs, backward=False)


@dataclasses.dataclass(frozen=True)
class PallasMosaicTpuGatedDeltaRule(_KernelConfigs, base.GatedDeltaRule[Config, None]):
  """Chunked gated delta rule in Pallas Mosaic TPU (forward + analytical VJP)."""

  max_head_dim: ClassVar[int | None] = 256
  supports_segment_states: ClassVar[bool] = True
  guards_in_core: ClassVar[bool] = True
  whole_guard_in_core: ClassVar[bool] = True
  prologue_in_core: ClassVar[bool] = True
  final_state_optional: ClassVar[bool] = True

  def __post_init__(self):
    if self.vjp is None:
      object.__setattr__(self, "vjp", PallasMosaicTpuGatedDeltaRuleVjp())

  def _core_fwd(self, q, k, v, g, beta, *, scale, initial_state,
                segment_ids, config: Config, poison=None, guard=False, use_qk_l2norm=False,
                a_log=None, dt_bias=None, beta_sigmoid=False, final_state=True):
    """The forward kernel on the raw q, k and gate (`prologue_in_core`);
    without `final_state` the final state is None, not computed."""
    interpret = _check_supported(q, v)

    def body(q, k, v, g, beta, initial_state, segment_ids, poison, a_log, dt_bias):
      pro = kernel.Prologue(qk_l2norm=use_qk_l2norm, a_log=a_log, dt_bias=dt_bias,
                            log_decay_floor=self.log_decay_floor, beta_sigmoid=beta_sigmoid)
      b, t = q.shape[:2]
      folded = _folds(config, q, v, "fwd", stateless=(
          initial_state is None and not final_state and not config.save_states
          and poison is None))
      if folded:
        q, k, v, g, beta = map(batch_fold.fold, (q, k, v, g, beta))
        segment_ids = batch_fold.segment_ids(segment_ids, b, t)
      out, final, res = kernel.gdn_fwd(
          q, k, v, g, beta, scale=scale, initial_state=initial_state,
          segment_ids=segment_ids, emit_residuals=config.save_states, final_state=final_state,
          poison=poison, guard=guard, pro=pro, **_kernel_args(config, q, v, interpret, "fwd"))
      if folded:
        out = batch_fold.unfold(out, b)
      return (out, final) + (tuple(res) if res is not None else ())

    # (`_per_shard` drops None results: no label for an absent final state.)
    out_labels = [_LABELS["d_out"]] + ([_state_label(initial_state)] if final_state else [])
    if config.save_states:
      out_labels += [_LABELS["states"], _LABELS["tmats"]] + ([_LABELS["guard_flags"]] if guard else [])
    res = _per_shard(body, out_labels, q.shape[2], v.shape[2], dict(
        q=q, k=k, v=v, g=g, beta=beta, initial_state=initial_state,
        segment_ids=segment_ids, poison=poison, a_log=a_log, dt_bias=dt_bias))
    out, final = (res[0], res[1]) if final_state else (res[0], None)
    saved = res[2 if final_state else 1:]
    if config.save_states:
      return out, final, base.Residuals(*saved)
    return out, final, base.Residuals()


@dataclasses.dataclass(frozen=True, kw_only=True)
class PallasMosaicTpuGatedDeltaRuleVjp(_KernelConfigs, base.GatedDeltaRuleVjp[Config, None]):
  """Reverse-chunk analytical backward of the Mosaic TPU GDN kernels."""

  guards_in_core: ClassVar[bool] = True
  whole_guard_in_core: ClassVar[bool] = True
  prologue_in_core: ClassVar[bool] = True

  heuristics = functools.partial(_heuristics, backward=True)
  autotuning_configs = functools.partial(_autotuning_configs, backward=True)

  def _core_bwd(self, residuals: base.Residuals | None, q, k, v, g, beta, d_out, d_final, *,
                scale, initial_state, segment_ids, config: Config, sanitize: bool = False,
                guard: bool = False, use_qk_l2norm=False, a_log=None, dt_bias=None,
                beta_sigmoid=False):
    """The kernels on the raw q, k and gate (`prologue_in_core`)."""
    interpret = _check_supported(q, v)
    t = q.shape[1]
    states = getattr(residuals, "states", None)
    tmats = getattr(residuals, "tmats", None)
    flags = getattr(residuals, "guard", None)
    if guard and flags is None:     # saved without the guard's flags: recompute
      states = tmats = None
    # Residuals the forward saved (save_states=True) fix the chunk size: the
    # backward runs at theirs if it fits in VMEM there, else recomputes.
    if states is not None and tmats is not None:
      saved = Config(chunk_size=tmats.shape[-1], interleave=config.interleave)
      if saved.chunk_size == config.chunk_size or _fits(saved, _shapes_of(q, v), "bwd"):
        config = saved
      else:
        states = tmats = None
    if initial_state is not None and initial_state.ndim == 5:   # the aligned layout's chunks
      t = segments.aligned_length(t, initial_state.shape[1], config.chunk_size)
    if states is not None and states.shape[1] != -(-t // config.chunk_size):
      states = tmats = None
    if states is None:
      flags = None

    def body(q, k, v, g, beta, d_out, d_final, states, tmats, guard_flags, initial_state,
             segment_ids, a_log, dt_bias):
      b, t = q.shape[:2]
      if _folds(config, q, v, "bwd", stateless=(
          initial_state is None and d_final is None and states is None)):
        grads = unfolded_body(
            *map(batch_fold.fold, (q, k, v, g, beta, d_out)), None, None, None, None, None,
            batch_fold.segment_ids(segment_ids, b, t), a_log, dt_bias)
        per_token = tuple(batch_fold.unfold(x, b) for x in grads[:5])
        # a_log's and dt_bias's per-row parts: the folded row's, then zeros.
        rows = tuple(jnp.concatenate([x, jnp.zeros((b - 1,) + x.shape[1:], x.dtype)])
                     for x in grads[6:])
        return per_token + (None,) + rows
      return unfolded_body(q, k, v, g, beta, d_out, d_final, states, tmats, guard_flags,
                           initial_state, segment_ids, a_log, dt_bias)

    def unfolded_body(q, k, v, g, beta, d_out, d_final, states, tmats, guard_flags,
                      initial_state, segment_ids, a_log, dt_bias):
      pro = kernel.Prologue(qk_l2norm=use_qk_l2norm, a_log=a_log, dt_bias=dt_bias,
                            log_decay_floor=self.log_decay_floor, beta_sigmoid=beta_sigmoid)
      if states is None:   # pass 1: the forward kernel without outputs
        _, _, saved = kernel.gdn_fwd(
            q, k, v, g, beta, scale=scale, initial_state=initial_state,
            segment_ids=segment_ids, write_out=False, emit_residuals=True, final_state=False,
            sanitize=sanitize, guard=guard, pro=pro,
            **_kernel_args(_states_config(config, _shapes_of(q, v)), q, v, interpret, "states"))
      else:
        saved = (states, tmats) + ((guard_flags,) if guard else ())
      return kernel.gdn_bwd(
          q, k, v, g, beta, d_out, d_final, scale=scale,
          initial_state=initial_state, segment_ids=segment_ids, residuals=saved,
          sanitize=sanitize, guard=guard, pro=pro, **_kernel_args(config, q, v, interpret, "bwd"))

    out_labels = [_LABELS[n] for n in ("q", "k", "v", "g", "beta")]
    if initial_state is not None:   # (else no d_initial: `_per_shard` drops the None)
      out_labels.append(_state_label(initial_state))
    if a_log is not None:   # each row's parts of a_log's and dt_bias's gradients
      out_labels += ["b one hv", "b one hv"]
    grads = _per_shard(body, out_labels, q.shape[2], v.shape[2], dict(
        q=q, k=k, v=v, g=g, beta=beta, d_out=d_out,
        d_final=d_final, states=states, tmats=tmats, guard_flags=flags, initial_state=initial_state,
        segment_ids=segment_ids, a_log=a_log, dt_bias=dt_bias))
    if initial_state is None:
      grads = (*grads[:5], None, *grads[5:])
    return grads


IMPLEMENTATION = PallasMosaicTpuGatedDeltaRule()
