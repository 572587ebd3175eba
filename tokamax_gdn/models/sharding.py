"""Data x model sharding of the decoder's mixers, for a `Mesh` with axes
("data", "model").

The Pallas kernels (GDN, conv, gmm/tgmm) cannot be split by XLA's
partitioner, and the compile-only TPU client used for AOT compiles does not
run their Python `custom_partitioning` rules, so each mixer that calls them
runs inside `jax.shard_map`, Megatron style: the batch (tokens) over "data",
heads (GDN) or expert intermediate columns (MoE) over "model", and one
`psum` over "model" of the output projection's partial sums. The kernels then
see per-device shapes. The attention blocks' core runs under `shard_map` too
(batch over "data", key/value heads over "model" where they divide);
everything else (embedding, norms, the attention projections, the LM head)
is left to `jax.jit`'s partitioner.

Without a mesh the same functions call the layer directly.

`check_vma=False`: Pallas calls declare no varying-axes types for their
outputs, which `check_vma=True` requires. The gradients of these mixers are
checked against unsharded ones on 8 host devices
(tests/models/sharding_checks.py).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig, gated_deltanet
from tokamax_gdn.models import blocks
from tokamax_gdn.models import softmax_attention

DATA = "data"
MODEL = "model"


def _model_size(mesh: Mesh) -> int:
  if DATA not in mesh.shape or MODEL not in mesh.shape:
    raise ValueError(f"The mesh needs axes {DATA!r} and {MODEL!r}; got {tuple(mesh.shape)}.")
  return mesh.shape[MODEL]


def _require_divisible(what: str, n: int, mesh: Mesh, axis: str) -> None:
  if n % mesh.shape[axis]:
    raise ValueError(f"{what}={n} must be divisible by the {axis!r} mesh axis ({mesh.shape[axis]}).")


def _gdn_segments(cfg: GatedDeltaNetConfig) -> tuple[list[int], list[int]]:
  """Split points of the fused `in_proj` columns [q k v z b a] and of the conv
  rows [q k v]: each segment is head-major, so splitting a segment over
  "model" gives each device whole heads (and whole GVA groups)."""
  kd, vd, hv = cfg.key_dim, cfg.value_dim, cfg.num_v_heads
  cols = [kd, 2 * kd, 2 * kd + vd, 2 * kd + 2 * vd, 2 * kd + 2 * vd + hv]
  return cols, [kd, 2 * kd]


def gdn_mixer(params, x: jax.Array, cfg: GatedDeltaNetConfig, *, implementation=None,
              mesh: Mesh | None = None, named_residuals: bool = False) -> jax.Array:
  """The GatedDeltaNet layer, heads split over "model" when `mesh` is given."""
  layer = functools.partial(gated_deltanet, implementation=implementation,
                            named_residuals=named_residuals)
  if mesh is None:
    return layer(params, x, cfg)
  m = _model_size(mesh)
  _require_divisible("num_k_heads", cfg.num_k_heads, mesh, MODEL)
  _require_divisible("batch", x.shape[0], mesh, DATA)
  local_cfg = dataclasses.replace(cfg, num_k_heads=cfg.num_k_heads // m,
                                  num_v_heads=cfg.num_v_heads // m)
  cols, rows = _gdn_segments(cfg)
  in_segs = tuple(jnp.split(params["in_proj"], cols, axis=1))
  conv_segs = tuple(jnp.split(params["conv_weight"], rows, axis=0))

  def local(in_segs, conv_segs, a_log, dt_bias, norm_weight, out_proj, x):
    p = dict(in_proj=jnp.concatenate(in_segs, axis=1),
             conv_weight=jnp.concatenate(conv_segs, axis=0),
             a_log=a_log, dt_bias=dt_bias, norm_weight=norm_weight, out_proj=out_proj)
    return jax.lax.psum(layer(p, x, local_cfg), MODEL)

  col, row = P(None, MODEL), P(MODEL, None)
  fn = jax.shard_map(
      local, mesh=mesh,
      in_specs=((col,) * len(in_segs), (row,) * len(conv_segs), P(MODEL), P(MODEL), P(),
                row, P(DATA)),
      out_specs=P(DATA), check_vma=False)
  return fn(in_segs, conv_segs, params["a_log"], params["dt_bias"], params["norm_weight"],
            params["out_proj"], x)


def attention_mixer(params, x: jax.Array, *, heads: int, kv_heads: int, head_dim: int,
                    eps: float, rope_theta: float, implementation=None,
                    mesh: Mesh | None = None) -> jax.Array:
  """`blocks.attention`; with `mesh`, its core (splash attention's Pallas
  kernels on TPU, which XLA's partitioner cannot split) under `shard_map`:
  the batch over "data", the key/value heads (with their query heads) over
  "model" when they divide evenly, else whole on every device. The
  projections around it are left to the partitioner."""
  shapes = dict(heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps,
                rope_theta=rope_theta)
  if mesh is None:
    return blocks.attention(params, x, implementation=implementation, **shapes)
  _require_divisible("batch", x.shape[0], mesh, DATA)
  head_axis = MODEL if kv_heads % _model_size(mesh) == 0 else None
  spec = P(DATA, None, head_axis, None)
  core = jax.shard_map(
      functools.partial(softmax_attention.causal_attention, implementation=implementation),
      mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec, check_vma=False)
  return blocks.attention(params, x, core=core, **shapes)


def moe_mixer(params, x: jax.Array, *, top_k: int, capacity_factor: float | None,
              norm_topk_prob: bool, implementation=None, mesh: Mesh | None = None):
  """`blocks.moe`, tokens over "data" (each data shard routes and sorts its
  own tokens: per-shard group sizes) and expert columns over "model"."""
  run = functools.partial(blocks.moe, top_k=top_k, capacity_factor=capacity_factor,
                          norm_topk_prob=norm_topk_prob, implementation=implementation)
  if mesh is None:
    return run(params, x)
  _model_size(mesh)
  _require_divisible("moe_intermediate_size", params["gate_proj"].shape[-1], mesh, MODEL)
  _require_divisible("batch", x.shape[0], mesh, DATA)

  def local(params, x):
    y, stats = run(params, x, model_axis=MODEL)
    # Shards route different tokens: the reported statistics are their means /
    # sums over "data" (identical across "model").
    stats = dict(aux_loss=jax.lax.pmean(stats["aux_loss"], DATA),
                 group_sizes=jax.lax.psum(stats["group_sizes"], DATA),
                 dropped=jax.lax.psum(stats["dropped"], DATA))
    return y, stats

  specs = dict(router=P(), gate_proj=P(None, None, MODEL), up_proj=P(None, None, MODEL),
               down_proj=P(None, MODEL, None))
  fn = jax.shard_map(local, mesh=mesh, in_specs=(specs, P(DATA)),
                     out_specs=(P(DATA), dict(aux_loss=P(), group_sizes=P(), dropped=P())),
                     check_vma=False)
  return fn(params, x)


def param_specs(params) -> dict:
  """PartitionSpecs for a decoder's params (stacked over periods): expert
  weights split over "model" on their intermediate axis, the rest replicated
  (the GDN mixer slices its heads out of the fused projection itself)."""
  def spec(path, leaf):
    names = [getattr(k, "key", None) for k in path]
    if "moe" in names and names[-1] in ("gate_proj", "up_proj"):
      return P(*([None] * (leaf.ndim - 1)), MODEL)
    if "moe" in names and names[-1] == "down_proj":
      return P(*([None] * (leaf.ndim - 2)), MODEL, None)
    return P()
  return jax.tree_util.tree_map_with_path(spec, params)
