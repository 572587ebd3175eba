"""Writes HF parity fixtures for the GatedDeltaNet layer (needs torch + transformers).

Run in a separate venv (CI never runs this; tests only read the .npz files):

  python -m venv /work/hfvenv && /work/hfvenv/bin/pip install torch transformers numpy
  /work/hfvenv/bin/python tools/make_hf_fixtures.py [--out tests/layers/fixtures]

For each variant (Qwen3-Next `Qwen3NextGatedDeltaNet`, Qwen3.5
`Qwen3_5GatedDeltaNet`) with tiny float32 shapes and random (not default-init)
weights, it stores: the layer's HF config values, every HF parameter
(`param/<hf name>`), an input `x`, a cotangent `cot`, the output `y`, and the
gradients of sum(y * cot) w.r.t. every parameter (`grad/<hf name>`) and x
(`grad_x`).
"""

import argparse
import json
import os

import numpy as np
import torch
import transformers

DIMS = dict(hidden_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6)
BATCH, SEQ = 2, 40


def _module(variant: str):
  common = dict(num_hidden_layers=1, hidden_act="silu", **DIMS)
  if variant == "qwen3_next":
    from transformers.models.qwen3_next import modeling_qwen3_next as m  # pylint: disable=g-import-not-at-top
    cfg = transformers.Qwen3NextConfig(**common)
    return m.Qwen3NextGatedDeltaNet(cfg, layer_idx=0)
  from transformers.models.qwen3_5 import modeling_qwen3_5 as m  # pylint: disable=g-import-not-at-top
  cfg = transformers.Qwen3_5TextConfig(**common)
  return m.Qwen3_5GatedDeltaNet(cfg, layer_idx=0)


def _randomise(module, gen):
  """Weights with O(1) activations everywhere, so every term is tested."""
  hidden = DIMS["hidden_size"]
  with torch.no_grad():
    for name, p in module.named_parameters():
      if name == "A_log":
        p.copy_(torch.log(torch.empty_like(p).uniform_(0.5, 4.0, generator=gen)))
      elif name == "dt_bias":
        p.copy_(0.5 * torch.randn(p.shape, generator=gen))
      elif name == "norm.weight":
        p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
      elif name == "conv1d.weight":
        p.copy_(torch.empty_like(p).uniform_(-0.6, 0.6, generator=gen))
      elif name == "out_proj.weight":
        p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(p.shape[1]))
      else:   # input projections
        p.copy_(torch.randn(p.shape, generator=gen) / np.sqrt(hidden))


def make(variant: str, seed: int) -> dict[str, np.ndarray]:
  torch.manual_seed(seed)
  gen = torch.Generator().manual_seed(seed)
  module = _module(variant).float()
  _randomise(module, gen)
  x = torch.randn(BATCH, SEQ, DIMS["hidden_size"], generator=gen, requires_grad=True)
  cot = torch.randn(BATCH, SEQ, DIMS["hidden_size"], generator=gen)
  y = module(x)
  (y * cot).sum().backward()
  out = {f"param/{n}": p.detach().numpy() for n, p in module.named_parameters()}
  out.update({f"grad/{n}": p.grad.numpy() for n, p in module.named_parameters()})
  out.update(x=x.detach().numpy(), cot=cot.numpy(), y=y.detach().numpy(),
             grad_x=x.grad.numpy())
  out["hf_config"] = np.array(json.dumps(dict(DIMS, variant=variant)))
  out["versions"] = np.array(json.dumps(dict(torch=torch.__version__,
                                             transformers=transformers.__version__)))
  return {k: (v.astype(np.float32) if v.dtype == np.float64 else v) for k, v in out.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(__file__), "..", "tests", "layers", "fixtures"))
  args = parser.parse_args()
  os.makedirs(args.out, exist_ok=True)
  for seed, variant in enumerate(("qwen3_next", "qwen3_5")):
    data = make(variant, seed)
    path = os.path.join(args.out, f"hf_{variant}.npz")
    np.savez_compressed(path, **data)
    print(f"{path}: {os.path.getsize(path)} bytes, y rms {np.sqrt(np.mean(data['y']**2)):.3f}")


if __name__ == "__main__":
  main()
