"""Named residuals of the gated delta rule, for `jax.checkpoint` policies to choose.

By default (`named_residuals=False`) the op keeps nothing beyond its inputs
and output for the backward, which recomputes what it needs (the Pallas
backward's first pass reruns the forward kernel for the chunk-entry states
and WY inverses). With `gated_delta_rule(..., named_residuals=True)` the
forward emits those instead, under names a policy can select:

  GDN_STATES "gdn_chunk_states"  states entering each chunk (Pallas: [B, NC,
                                 Hv, K, V]; xla: entering each block)
  GDN_TMAT   "gdn_tmat"          each chunk's WY inverse T' (Pallas)
  GDN_OUT    "gdn_out"           the op's output (the layer's backward needs
                                 it; saved, the forward is not rerun for it)
  CONV_OUT   "gdn_conv_out"      the layer's causal-conv output (named by
                                 `layers.gated_deltanet`)

Under `jax.checkpoint(fn, policy=...)` XLA then keeps them (`SAVE`),
offloads them to host memory (`OFFLOAD`) or recomputes them (`RECOMPUTE`,
nothing saveable: the backward reruns the forward, which emits them again,
and its states pass is skipped). Without `jax.checkpoint` they are simply
kept (as the Pallas `save_states=True` config does).

How: tokamax builds each Op's custom VJP with `optimize_remat=True`, which
wraps the forward rule in one opaque primitive, so names given inside it are
invisible to a policy. `call` wraps the op in a custom VJP of its own whose
forward rule runs the op's forward with residuals and names them in the
caller's trace, and whose backward rule calls the op's VJP Op with them.
"""

import dataclasses
from typing import Literal

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp

GDN_STATES = "gdn_chunk_states"
GDN_TMAT = "gdn_tmat"
GDN_OUT = "gdn_out"
CONV_OUT = "gdn_conv_out"
NAMES = (GDN_STATES, GDN_TMAT, GDN_OUT, CONV_OUT)

# What `call` names by default: residual role -> checkpoint name. Roles:
# "out", "states", "tmats" (the residuals above) and the op's inputs "query",
# "key", "value", "g", "beta" (saved by the backward as they are; unnamed by
# default). `call(..., names=...)` takes another mapping (e.g. MaxText's
# names, `tokamax_gdn.integrations.maxtext`); a role it leaves out is unnamed.
DEFAULT_NAMES = {"out": GDN_OUT, "states": GDN_STATES, "tmats": GDN_TMAT}

RematPolicy = Literal["recompute", "save_gdn", "offload_gdn"]
RECOMPUTE, SAVE, OFFLOAD = "recompute", "save_gdn", "offload_gdn"
POLICIES = (RECOMPUTE, SAVE, OFFLOAD)


def checkpoint_policy(name: str):
  """The `jax.checkpoint` policy of a remat policy name (see the module docstring).

  "recompute": nothing saveable; "save_gdn": the GDN names kept on device;
  "offload_gdn": the GDN names offloaded to pinned host memory.
  """
  policies = jax.checkpoint_policies
  if name == RECOMPUTE:
    return policies.nothing_saveable
  if name == SAVE:
    return policies.save_only_these_names(*NAMES)
  if name == OFFLOAD:
    return policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=list(NAMES),
        offload_src="device", offload_dst="pinned_host")
  raise ValueError(f"remat policy {name!r}: expected one of {', '.join(POLICIES)}")


def _emitting(op, ba):
  """`op` with the config of this call, set to emit its residuals (Pallas:
  `save_states=True`; implementations without that switch emit theirs anyway)."""
  config = ba.default_config
  if hasattr(config, "save_states") and not config.save_states:
    config = dataclasses.replace(config, save_states=True)
  return op.replace(config=config)


def _named(residuals, names):
  fields = dict(states=names.get("states"), tmats=names.get("tmats"),
                guard=names.get("states"))
  return dataclasses.replace(residuals, **{
      f: checkpoint_name(getattr(residuals, f), name) for f, name in fields.items()
      if name is not None and getattr(residuals, f) is not None})


def call(op, query, key, value, g, beta, *, initial_state=None, a_log=None, dt_bias=None,
         segment_ids=None, names=None, **static):
  """`op(query, ..., **static)` -> (out, final_state), with named residuals.

  `op` is a gated-delta-rule Op with an analytical VJP (`op.vjp`); `static`
  holds its non-array keywords (scale, output_final_state, use_qk_l2norm,
  use_beta_sigmoid). `names`: role -> checkpoint name (default `DEFAULT_NAMES`).
  Raises NotImplementedError for an op without one (callers fall through).
  """
  if op.vjp is None:
    raise NotImplementedError(f"{type(op).__name__} has no analytical VJP to give residuals to")
  arrays = (query, key, value, g, beta, initial_state, a_log, dt_bias, segment_ids)
  ba = op.bind(*arrays[:5], initial_state=initial_state, a_log=a_log, dt_bias=dt_bias,
               segment_ids=segment_ids, **static)
  emitting = _emitting(op, ba)

  def keywords(xs):
    return dict(initial_state=xs[5], a_log=xs[6], dt_bias=xs[7], segment_ids=xs[8], **static)

  @jax.custom_vjp
  def named(*xs):
    return op(*xs[:5], **keywords(xs))

  names = DEFAULT_NAMES if names is None else names
  inputs = ("query", "key", "value", "g", "beta")

  def named_fwd(*xs):
    xs = tuple(checkpoint_name(x, names[r]) if r in names else x
               for r, x in zip(inputs, xs[:5])) + xs[5:]
    (out, final), residuals = emitting(*xs[:5], **keywords(xs), return_residuals=True)
    # Named (so saved) as [B, T, Hv V], the Pallas kernels' own output (the
    # layer reads it so too): saved as [B, T, Hv, V], tiled over (Hv, V) on
    # TPU, XLA copied the kernel's output into it and the output's cotangent
    # back.
    if "out" in names:
      out = checkpoint_name(out.reshape(*out.shape[:2], -1), names["out"]).reshape(out.shape)
    residuals = None if residuals is None else _named(residuals, names)
    return (out, final), (xs, out, final, residuals)

  def named_bwd(saved, cts):
    xs, out, final, residuals = saved
    bound = emitting.bind(*xs[:5], **keywords(xs))
    kwargs = dict(bound.kwargs)
    kwargs.pop("return_residuals", None)
    grads = op.vjp(residuals, (out, final), cts, *bound.args, **kwargs)
    names = ("query", "key", "value", "g", "beta", "initial_state", "a_log", "dt_bias")
    return tuple(None if x is None else grads.get(n, jnp.zeros_like(x))
                 for n, x in zip(names, xs)) + (None,)   # segment ids: integers

  named.defvjp(named_fwd, named_bwd)
  return named(*arrays)
