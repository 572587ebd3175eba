"""The Hugging Face weight layout of a GatedDeltaNet (`linear_attn`) layer.

`HF_NAMES` lists one layer's tensor names per variant; `params_from_hf` /
`params_to_hf` re-lay them to and from the layer's params (see
`gated_deltanet`'s docstring for the fused `in_proj`); `load_hf_layer` reads
one layer from a safetensors checkpoint.

`load_hf_layer` needs the `safetensors` package (`pip install safetensors`;
not a dependency of tokamax_gdn itself). Only the tensors of the requested
layer are read: a safetensors file is memory-mapped and read per tensor, so
loading one layer of an 80B checkpoint touches that layer's bytes only.
"""

import json
import os
from typing import Any

import jax.numpy as jnp
import numpy as np

from tokamax_gdn.layers.gated_deltanet import GatedDeltaNetConfig, Params, split_in_proj  # pylint: disable=g-multiple-import

_F32_PARAMS = ("a_log", "dt_bias")


# HF parameter names of one `linear_attn` layer, per variant.
_HF_COMMON = ("conv1d.weight", "dt_bias", "A_log", "norm.weight", "out_proj.weight")
HF_NAMES = {
    "qwen3_next": ("in_proj_qkvz.weight", "in_proj_ba.weight", *_HF_COMMON),
    "qwen3_5": ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight",
                "in_proj_a.weight", *_HF_COMMON),
}


def _layer_tensors(state_dict: dict[str, Any], cfg: GatedDeltaNetConfig,
                   prefix: str | None) -> dict[str, np.ndarray]:
  """One layer's tensors under their bare HF names (see `params_from_hf`)."""
  if prefix is not None:
    sd = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
    if not sd:
      near = sorted({k[:k.rfind(".") + 1] for k in state_dict})[:8]
      raise ValueError(f"No key starts with prefix={prefix!r}; key prefixes here: {near}.")
  else:
    # Without a prefix the dict must hold one layer: bare names, or names under
    # a single `....linear_attn.` prefix. Two layers' worth would silently load
    # whichever came last, so they are refused.
    prefixes = {k[:k.rfind("linear_attn.") + len("linear_attn.")] if "linear_attn." in k else ""
                for k in state_dict}
    if len(prefixes) > 1:
      raise ValueError(
          f"Keys of more than one layer ({sorted(prefixes)}): pass prefix= to choose one,"
          " e.g. prefix='model.layers.0.linear_attn.'.")
    pre = prefixes.pop() if prefixes else ""
    sd = {k[len(pre):]: v for k, v in state_dict.items()}
  if "conv1d.bias" in sd:
    raise ValueError("HF `conv1d.bias` is present; Qwen3-Next / Qwen3.5 convs have no bias.")
  unknown = sorted(set(sd) - set(HF_NAMES[cfg.variant]))
  if unknown:
    raise ValueError(f"Keys that name no {cfg.variant!r} `linear_attn` parameter: {unknown}"
                     f" (expected {list(HF_NAMES[cfg.variant])}).")
  return {k: np.asarray(v) for k, v in sd.items()}


def params_from_hf(state_dict: dict[str, Any], cfg: GatedDeltaNetConfig,
                   dtype=None, *, prefix: str | None = None) -> Params:
  """One HF `linear_attn` layer's tensors -> params.

  Accepts NumPy arrays (or anything `np.asarray` takes: jax arrays, CPU torch
  tensors). `prefix` (e.g. `"model.layers.3.linear_attn."`) picks one layer
  out of a larger state dict (a checkpoint shard, a whole model): only keys
  that start with it are read. Without `prefix`, `state_dict` must hold one
  layer: bare names (`"A_log"`) or all under one `....linear_attn.` prefix;
  keys of two layers raise ValueError. A key that names no parameter of
  `cfg.variant` (a misspelling, `conv1d.bias`) raises ValueError naming it; a
  missing one raises KeyError. `dtype` (default: as stored) applies to all
  but `a_log` / `dt_bias`, which are kept float32.
  """
  sd = _layer_tensors(state_dict, cfg, prefix)
  hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
  r = hv // hk
  hidden = cfg.hidden_size

  def need(name, shape):
    if name not in sd:
      raise KeyError(f"HF weight {name!r} missing for variant {cfg.variant!r}; got {sorted(sd)}.")
    if tuple(sd[name].shape) != tuple(shape):
      raise ValueError(f"HF weight {name!r}: expected shape {tuple(shape)}, got {tuple(sd[name].shape)}.")
    return sd[name]

  if cfg.variant == "qwen3_next":
    qkvz = need("in_proj_qkvz.weight", (2 * cfg.key_dim + 2 * cfg.value_dim, hidden))
    ba = need("in_proj_ba.weight", (2 * hv, hidden))
    qkvz = qkvz.reshape(hk, 2 * dk + 2 * r * dv, hidden)
    q, k = qkvz[:, :dk], qkvz[:, dk:2 * dk]
    v, z = qkvz[:, 2 * dk:2 * dk + r * dv], qkvz[:, 2 * dk + r * dv:]
    ba = ba.reshape(hk, 2 * r, hidden)
    b, a = ba[:, :r], ba[:, r:]
    flat = lambda t: t.reshape(-1, hidden)
    rows = [flat(q), flat(k), flat(v), flat(z), flat(b), flat(a)]
  else:
    rows = [need("in_proj_qkv.weight", (cfg.conv_dim, hidden)),
            need("in_proj_z.weight", (cfg.value_dim, hidden)),
            need("in_proj_b.weight", (hv, hidden)),
            need("in_proj_a.weight", (hv, hidden))]
  conv = need("conv1d.weight", (cfg.conv_dim, 1, cfg.conv_kernel_size))
  params = dict(
      in_proj=np.concatenate(rows, axis=0).T,
      conv_weight=conv[:, 0, :],
      dt_bias=need("dt_bias", (hv,)),
      a_log=need("A_log", (hv,)),
      norm_weight=need("norm.weight", (dv,)),
      out_proj=need("out_proj.weight", (hidden, cfg.value_dim)).T,
  )
  # The gate parameters stay float32 whatever `dtype` (HF computes the gate in
  # float32 too: exp(A_log) in bf16 would be off by up to 0.4 %).
  return {k: jnp.asarray(v, jnp.float32 if k in _F32_PARAMS else (dtype or v.dtype))
          for k, v in params.items()}


def params_to_hf(params: Params,
                 cfg: GatedDeltaNetConfig) -> dict[str, np.ndarray]:
  """Inverse of `params_from_hf` (NumPy, HF names); maps gradients the same way."""
  p = {k: np.asarray(v) for k, v in params.items()}
  hk, hv, dk, dv = cfg.num_k_heads, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim
  r = hv // hk
  hidden = cfg.hidden_size
  w_in = p["in_proj"].T                                    # [P, hidden]
  qkv, z, b, a = split_in_proj(w_in.T, cfg)
  qkv, z, b, a = qkv.T, z.T, b.T, a.T
  out = {}
  if cfg.variant == "qwen3_next":
    q = qkv[:cfg.key_dim].reshape(hk, dk, hidden)
    k = qkv[cfg.key_dim:2 * cfg.key_dim].reshape(hk, dk, hidden)
    v = qkv[2 * cfg.key_dim:].reshape(hk, r * dv, hidden)
    zz = z.reshape(hk, r * dv, hidden)
    out["in_proj_qkvz.weight"] = np.concatenate([q, k, v, zz], axis=1).reshape(-1, hidden)
    out["in_proj_ba.weight"] = np.concatenate(
        [b.reshape(hk, r, hidden), a.reshape(hk, r, hidden)], axis=1).reshape(-1, hidden)
  else:
    out["in_proj_qkv.weight"] = qkv
    out["in_proj_z.weight"] = z
    out["in_proj_b.weight"] = b
    out["in_proj_a.weight"] = a
  out["conv1d.weight"] = p["conv_weight"][:, None, :]
  out["dt_bias"] = p["dt_bias"]
  out["A_log"] = p["a_log"]
  out["norm.weight"] = p["norm_weight"]
  out["out_proj.weight"] = p["out_proj"].T
  return {k: np.ascontiguousarray(v) for k, v in out.items()}


# ----------------------------------------------------------------------------
# Reading safetensors checkpoints.

INDEX = "model.safetensors.index.json"   # HF's map from tensor name to shard file
SINGLE = "model.safetensors"             # HF's name for an unsharded checkpoint


def _files_holding(path: str, prefix: str) -> list[str]:
  """The safetensors files under `path` that may hold keys starting with `prefix`."""
  if not os.path.isdir(path):
    return [path]
  index = os.path.join(path, INDEX)
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    files = sorted({fn for k, fn in weight_map.items() if k.startswith(prefix)})
    if not files:
      raise ValueError(f"{index} names no tensor starting with prefix={prefix!r}.")
    return [os.path.join(path, fn) for fn in files]
  if os.path.exists(os.path.join(path, SINGLE)):
    return [os.path.join(path, SINGLE)]
  raise FileNotFoundError(f"{path} holds neither {INDEX} nor {SINGLE}.")


def load_hf_layer(path: str, cfg: GatedDeltaNetConfig, *, prefix: str,
                  dtype=None) -> Params:
  """Params of the `linear_attn` layer whose tensors start with `prefix`.

  Args:
    path: a `.safetensors` file, or an HF checkpoint directory (sharded, with
      `model.safetensors.index.json`, or a single `model.safetensors`).
    cfg: the layer's config (e.g. `GatedDeltaNetConfig.from_hf_config` of the
      checkpoint's `config.json`).
    prefix: the layer's key prefix as the checkpoint's index spells it, e.g.
      `"model.layers.0.linear_attn."` (Qwen3-Next).
    dtype: as in `params_from_hf`.

  Raises what `params_from_hf` raises (unknown or missing names, shapes), and
  ValueError when no tensor starts with `prefix`.
  """
  try:
    from safetensors import safe_open  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("load_hf_layer reads safetensors files: pip install safetensors") from e
  tensors = {}
  for fn in _files_holding(path, prefix):
    with safe_open(fn, framework="numpy") as f:
      for k in f.keys():
        if k.startswith(prefix):
          tensors[k] = f.get_tensor(k)
  return params_from_hf(tensors, cfg, dtype, prefix=prefix)
