"""Named serving workloads: tokamax's own list, plus small and odd ones.

- Every spec of tokamax 0.0.17's `causal_conv1d_gated_delta_rule/arg_specs.py`
  (Qwen3.5-397B TP8 / DP4 / DP8, Qwen3.5-35B, Qwen3.8-Max; decode, cached
  decode, prefill, mixed, padded, speculative windows), under the same names
  with their project as a tag, built by tokamax's own `make_gdn_spec` (so the
  request layout, slots and offsets are exactly theirs). The six of issue 22's
  AOT table are also tagged 'aot'.
- CPU-scaled versions of those layouts (small heads, short prefills) and odd
  cases (GVA 1:4, d_k = d_v = 128 at T = 24, padded batches, context > 0,
  verify windows, f32 and bf16 pools): four tagged 'conformance' (three also
  'interpret', for Pallas interpret mode), the others 'odd'. On a chip the
  Pallas kernels run heads of other sizes padded to 128 lanes; the 'dk128'
  ones run there at the kernels' own size.
- The decode and prefill parts of the two mixed AOT workloads as separate
  calls ('aot_parts'), to compare the mixed calls with.
- The benchmark workloads of `tokamax-gdn bench` ('bench'): Hk=2, Hv=8,
  K=V=128, bf16 (a 2048-token prefill, decode_64, a mixed batch).

A spec's `make(key)` gives fresh random inputs with the layout's concrete
index arrays (query_start_loc, state_indices, distribution, seq_lens,
read_offsets), and random (not zero) pools, so a wrong read or a stray write
shows.
"""

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tokamax._src.ops.causal_conv1d_gated_delta_rule import arg_specs as tokamax_specs

from tokamax_gdn.autotuning import ArgSpec

POSITIONAL = ("qkv", "b", "a", "conv_state", "recurrent_state", "conv_weight", "conv_bias",
              "a_log", "dt_bias", "query_start_loc", "state_indices", "distribution",
              "seq_lens", "read_state_indices", "read_offsets")
STATIC = ("n_kq", "n_v", "d_k", "d_v", "kernel_size", "num_spec_tokens")

# Issue 22's AOT table (tokamax names).
AOT_NAMES = ("tp8_decode_64", "tp8_decode_512", "tp8_decode_cached_64_ctx8192",
             "tp8_prefill_4096", "tp8_mixed_3x512", "tp8_mixed_64_t8192")


@jax.jit(static_argnums=1)
def _draw(key: jax.Array, shapes: tuple[tuple[str, tuple[int, ...], str], ...]
          ) -> dict[str, jax.Array]:
  """The random arrays of `random_call`, in one program (drawn eagerly, each
  array's draw, scale and cast would be compiles of their own, per layout,
  each a fixed cost on a TPU)."""
  ks = iter(jax.random.split(key, 16))
  out = {}
  for name, shape, dtype in shapes:
    k = next(ks)
    if name == "conv_weight":
      bound = shape[-1] ** -0.5
      x = jax.random.uniform(k, shape, jnp.float32, -bound, bound)
    else:
      scale = {"recurrent_state": 0.1, "conv_bias": 0.1, "a_log": 0.5}.get(name, 1.0)
      x = scale * jax.random.normal(k, shape, jnp.float32)
    out[name] = x.astype(dtype)
  return out


def random_call(key: jax.Array, layout: dict[str, Any]) -> tuple[tuple, dict]:
  """(args, kwargs) for one call: random arrays where `layout` has
  ShapeDtypeStructs, its concrete index arrays and sizes as they are.

  Scales keep the recurrence in its working range: conv weights
  U(-1/sqrt(W), 1/sqrt(W)) (PyTorch's init), unit-normal activations and
  gates, pools of unit-normal conv inputs and 0.1-normal states.
  """
  drawn = {n: x for n in POSITIONAL if isinstance(x := layout.get(n), jax.ShapeDtypeStruct)}
  arrays = _draw(key, tuple((n, x.shape, jnp.dtype(x.dtype).name) for n, x in drawn.items()))

  def draw(name, x):
    if name in arrays:
      return arrays[name]
    return None if x is None else (jnp.asarray(x) if isinstance(x, np.ndarray) else x)

  values = {n: draw(n, layout.get(n)) for n in POSITIONAL}
  args = tuple(values[n] for n in POSITIONAL[:13])
  kwargs = {n: values[n] for n in POSITIONAL[13:] if values[n] is not None}
  kwargs.update({n: layout[n] for n in STATIC if n in layout})
  return args, kwargs


def layout(*, lengths: Sequence[int], n_kq: int, n_v: int, d_k: int = 128, d_v: int = 128,
           kernel_size: int = 4, context_lens: Sequence[int] | int = 0,
           max_reqs: int | None = None, num_decode: int | None = None,
           num_spec_tokens: int = 0, dtype=jnp.bfloat16, state_dtype=jnp.bfloat16
           ) -> dict[str, Any]:
  """A request layout in tokamax's conventions (its `make_gdn_spec`), except
  that padding requests point at the null slot 0 and verify windows may be
  followed by prefills.

  Slot 0 is the null slot; request i owns slots 1 + i (s + 1) .. + s (s =
  num_spec_tokens). The leading 1-token requests (all requests of at most
  s + 1 tokens with s > 0) decode; the decode requests' read_offsets cycle
  through their windows, as tokamax's.
  """
  n = len(lengths)
  max_reqs = n if max_reqs is None else max_reqs
  window = num_spec_tokens + 1
  ctx = [context_lens] * n if isinstance(context_lens, int) else list(context_lens)
  if num_decode is None:
    num_decode = 0
    while num_decode < n and lengths[num_decode] <= (window if num_spec_tokens else 1):
      num_decode += 1
  dim = 2 * n_kq * d_k + n_v * d_v
  num_slots = 1 + max_reqs * window
  qsl = np.cumsum([0] + list(lengths)).astype(np.int32)
  qsl = np.pad(qsl, (0, max_reqs + 1 - qsl.size), constant_values=qsl[-1])
  seq_lens = np.zeros(max_reqs, np.int32)
  seq_lens[:n] = [l + c for l, c in zip(lengths, ctx)]
  slots = np.zeros(max_reqs, np.int32)
  slots[:n] = 1 + np.arange(n) * window
  t = int(sum(lengths))
  sds = jax.ShapeDtypeStruct
  out = dict(
      qkv=sds((t, dim), dtype), b=sds((t, n_v), dtype), a=sds((t, n_v), dtype),
      conv_state=sds((num_slots, kernel_size - 1, dim), state_dtype),
      recurrent_state=sds((num_slots, n_v, d_k, d_v), state_dtype),
      conv_weight=sds((dim, 1, kernel_size), dtype), conv_bias=sds((dim,), dtype),
      a_log=sds((n_v,), jnp.float32), dt_bias=sds((n_v,), dtype),
      query_start_loc=qsl, state_indices=slots,
      distribution=np.array([num_decode, n, n], np.int32), seq_lens=seq_lens,
      n_kq=n_kq, n_v=n_v, d_k=d_k, d_v=d_v, kernel_size=kernel_size)
  if num_spec_tokens:
    offsets = np.zeros(max_reqs, np.int32)
    offsets[:num_decode] = np.arange(num_decode) % window
    out.update(read_offsets=offsets, num_spec_tokens=num_spec_tokens)
  return out


_LAYOUTS: dict[str, dict[str, Any]] = {}


def _from_layout(name: str, lay: dict[str, Any], tags: tuple[str, ...]) -> ArgSpec:
  _LAYOUTS[name] = lay
  return ArgSpec(name=name, make=lambda key: random_call(key, lay), diff_argnames=(),
                 tags=tags, vmap_ok=False)


def spec(name: str, *, tags: Sequence[str] = ("conformance",), **kw) -> ArgSpec:
  """A spec from `layout`'s keywords."""
  return _from_layout(name, layout(**kw), tuple(tags))


def _tokamax() -> list[ArgSpec]:
  out = []
  for s in tokamax_specs.ARG_SPECS:
    name = s.name if s.project == "qwen3_5_397b" else f"{s.project}_{s.name}"
    tags = ("tokamax", s.project) + (("aot",) if name in AOT_NAMES else ())
    out.append(_from_layout(name, dict(s.args), tags))
  return out


_TINY = dict(n_kq=1, n_v=2, d_k=16, d_v=16)
_GVA4 = dict(n_kq=1, n_v=4, d_k=32, d_v=16)
_BENCH = dict(n_kq=2, n_v=8, d_k=128, d_v=128)
_C, _I, _O = ("conformance",), ("conformance", "interpret"), ("odd",)
f32 = dict(dtype=jnp.float32, state_dtype=jnp.float32)

ARG_SPECS: list[ArgSpec] = [
    # CPU-scaled layouts of tokamax's ci_tests specs: the conformance suite's
    # cases (few: each compiles every implementation).
    spec("tiny_mixed_padded_ctx", lengths=[1] * 3 + [9, 2, 17], context_lens=[4, 4, 4, 0, 3, 0],
         max_reqs=8, tags=_I, **_TINY, **f32),
    spec("tiny_spec3_windows", lengths=[4, 2, 1, 3], context_lens=7, num_spec_tokens=3,
         tags=_I, **_TINY, **f32),
    spec("gva_1to4_mixed_ctx", lengths=[1, 1, 23], context_lens=[9, 9, 30], tags=_C, **_GVA4,
         **f32),
    spec("bf16_mixed_ctx", lengths=[1, 1, 1, 29], context_lens=[6, 6, 6, 12], tags=_I, **_TINY),
    # Odd ones (the op's own tests build these layouts too).
    spec("tiny_decode_8_ctx", lengths=[1] * 8, context_lens=5, tags=_O, **_TINY, **f32),
    spec("tiny_prefill_37", lengths=[37], tags=_O, **_TINY, **f32),
    spec("tiny_padded_decode_6_max12", lengths=[1] * 6, context_lens=2, max_reqs=12, tags=_O,
         **_TINY, **f32),
    spec("tiny_spec1_and_prefill", lengths=[2, 1, 11], context_lens=[5, 5, 0],
         num_spec_tokens=1, tags=_O, **_TINY, **f32),
    spec("dk128_mixed", lengths=[1, 1, 22], context_lens=[3, 3, 0], n_kq=1, n_v=1, d_k=128,
         d_v=128, tags=_O, **f32),
    spec("dk128_spec3_bf16_padded", lengths=[4, 2, 3], context_lens=[9, 9, 5],
         num_spec_tokens=3, max_reqs=4, n_kq=1, n_v=2, d_k=128, d_v=128, tags=_O),
    spec("bf16_spec3_padded", lengths=[4, 3], context_lens=9, num_spec_tokens=3, max_reqs=4,
         tags=_O, **_TINY),
    # tokamax's named workloads (Qwen3.5-397B and friends).
    *_tokamax(),
    # The parts of the mixed AOT workloads, as separate calls (`tokamax-gdn
    # aot --specs`): tp8_mixed_64_t8192 = 63 fresh decodes + one fresh
    # 8129-token prefill; tp8_mixed_3x512 = fresh prefills of 256, 128, 128.
    spec("tp8_mixed_64_t8192_decode_part", lengths=[1] * 63, tags=("aot_parts",), **_BENCH),
    spec("tp8_mixed_64_t8192_prefill_part", lengths=[8129], tags=("aot_parts",), **_BENCH),
    spec("tp8_prefill_256", lengths=[256], tags=("aot_parts",), **_BENCH),
    spec("tp8_prefill_128", lengths=[128], tags=("aot_parts",), **_BENCH),
    # `tokamax-gdn bench` (CPU): ours vs tokamax's xla op.
    spec("bench_prefill_2048", lengths=[2048], tags=("bench",), **_BENCH),
    spec("bench_decode_64", lengths=[1] * 64, context_lens=1024, tags=("bench",), **_BENCH),
    spec("bench_mixed_63_t1024", lengths=[1] * 63 + [961], context_lens=[1024] * 63 + [0],
         tags=("bench",), **_BENCH),
]


# Each mixed AOT workload and the separate calls it is made of (the 'aot_parts'
# specs above), for the mixed call's time against its parts' sum.
PARTS = {
    "tp8_mixed_64_t8192": ("tp8_mixed_64_t8192_decode_part", "tp8_mixed_64_t8192_prefill_part"),
    "tp8_mixed_3x512": ("tp8_prefill_256", "tp8_prefill_128", "tp8_prefill_128"),
}


def layout_of(name: str) -> dict[str, Any]:
  """The layout a spec draws from: ShapeDtypeStructs, concrete index arrays, sizes."""
  by_name(name)
  return _LAYOUTS[name]


def by_name(name: str) -> ArgSpec:
  """The spec named `name`."""
  for s in ARG_SPECS:
    if s.name == name:
      return s
  raise ValueError(f"No causal_conv1d_gated_delta_rule spec named {name!r}.")
