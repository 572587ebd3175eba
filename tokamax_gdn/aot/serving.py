"""Static TPU report of the serving op, compiled on CPU (`tokamax-gdn aot --op
causal_conv1d_gated_delta_rule`).

Per workload (the op's arg specs tagged 'aot': issue 22's Qwen3.5-397B TP8
set) and one implementation: the compiler's static cycle estimate of every
kernel and XLA fusion of the call (pools donated, as an engine calls it;
index arrays traced), summed; the HBM floor, the bytes the call must move
(each valid request's read-slot states when it continues one, its written
checkpoints, the tokens' qkv, b, a in and out) over the generation's HBM
bytes per cycle on the estimator's own scale (`tokamax_gdn.config`); and the
ratio. Each workload compiles in a child process (`aot.compile_in_child`).

The estimate is static: a loop body is counted once whatever its trip count
(the `xla` implementation's decode and prefill loops run a data-dependent
number of times), so for `xla` the total is a lower bound; `loop_steps` says
how many times each loop runs on the workload.
"""

import contextlib
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tokamax_gdn import aot
from tokamax_gdn import config
from tokamax_gdn import registry
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs

OP = "causal_conv1d_gated_delta_rule"
_BUILDER = "tokamax_gdn.aot.serving:cases"


def _abstract(spec, mesh: Mesh):
  """(positional, keyword arrays, static) of a spec, every array abstract on `mesh`."""
  args, kwargs = spec.abstract()
  rep = NamedSharding(mesh, P())

  def place(x):
    if x is None:
      return None
    x = x if hasattr(x, "dtype") else np.asarray(x)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep)

  static = {k: v for k, v in kwargs.items() if k in arg_specs.STATIC}
  arrays = {k: place(v) for k, v in kwargs.items() if k not in arg_specs.STATIC}
  return [place(a) for a in args], arrays, static


def cases(mesh: Mesh, spec_name: str, implementation: str) -> list[aot.Case]:
  """The call of `implementation` on the spec (an `aot.compile_in_child` builder)."""
  spec = arg_specs.by_name(spec_name)
  args, arrays, static = _abstract(spec, mesh)
  impl = registry.get(OP, implementation)
  rest = args[:3] + args[5:]
  names = list(arrays)
  # compile_for takes a flat list of arrays: None arguments stay in the closure.
  flat = list(rest) + [arrays[n] for n in names]
  present = [i for i, x in enumerate(flat) if x is not None]

  def call(conv, rec, *values):
    full = [None] * len(flat)
    for i, x in zip(present, values):
      full[i] = x
    pos, kw = full[:len(rest)], dict(zip(names, full[len(rest):]))
    with _cost_model(implementation, spec_name):
      return impl(*pos[:3], conv, rec, *pos[3:], **kw, **static)

  call.aot_donate_argnums = (0, 1)
  return [(f"{implementation}|{spec_name}", call,
           [args[3], args[4], *[flat[i] for i in present]])]


def _cost_model(implementation: str, spec_name: str):
  """pallas_mosaic_tpu: its decode kernel without per-request branches, as if
  every request ran, from a read state when any of the workload's requests
  continues one (libtpu's estimate leaves data-dependent branch bodies out;
  see `pallas_mosaic_tpu.full_decode_cost`), and its chunked GDN kernel at
  static block indices, every block running when any request is chunked
  (`pallas_mosaic_tpu.full_chunk_cost`: the estimator aborts on the real
  kernel's SMEM block indices)."""
  if implementation != "pallas_mosaic_tpu":
    return contextlib.nullcontext()
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu  # pylint: disable=g-import-not-at-top
  spec = arg_specs.by_name(spec_name)
  stack = contextlib.ExitStack()
  stack.enter_context(pallas_mosaic_tpu.full_decode_cost(has_init=any_reads(spec)))
  stack.enter_context(pallas_mosaic_tpu.full_chunk_cost(run=any_chunked(spec)))
  return stack


def any_chunked(spec) -> bool:
  """Whether a valid request of the spec takes the Pallas chunked path (a
  non-decode of at least the heuristic's `min_chunked_tokens`)."""
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import pallas_mosaic_tpu  # pylint: disable=g-import-not-at-top
  lay = arg_specs.layout_of(spec.name)
  qsl, dist = np.asarray(lay["query_start_loc"]), np.asarray(lay["distribution"])
  n_valid = min(int(dist[2]), lay["state_indices"].shape[0])
  lengths = np.diff(qsl[:n_valid + 1])[int(dist[0]):]
  return bool(np.any(lengths >= pallas_mosaic_tpu.Config().min_chunked_tokens))


def any_reads(spec) -> bool:
  """Whether a valid request of the spec starts from its read slot's states."""
  lay = arg_specs.layout_of(spec.name)
  qsl, dist, seq_lens = (np.asarray(lay[n]) for n in ("query_start_loc", "distribution",
                                                     "seq_lens"))
  n_valid = min(int(dist[2]), seq_lens.shape[0])
  return bool(np.any(seq_lens[:n_valid] > np.diff(qsl[:n_valid + 1])))


def hbm_bytes(spec) -> int:
  """Bytes a call must move: states read / checkpoints written, tokens in and out."""
  lay = arg_specs.layout_of(spec.name)
  qkv, conv, rec = lay["qkv"], lay["conv_state"], lay["recurrent_state"]
  qsl, slots, dist, seq_lens = (np.asarray(lay[n]) for n in (
      "query_start_loc", "state_indices", "distribution", "seq_lens"))
  window = lay.get("num_spec_tokens", 0) + 1
  item = lambda x: jnp.dtype(x.dtype).itemsize
  slot_bytes = (np.prod(conv.shape[1:]) * item(conv) + np.prod(rec.shape[1:]) * item(rec))
  n_valid = min(int(dist[2]), slots.shape[0])
  n_decode = min(int(dist[0]), n_valid)
  total = 0
  for r in range(n_valid):
    length = int(qsl[r + 1] - qsl[r])
    if length <= 0:
      continue
    written = min(length, window) if r < n_decode else 1
    total += slot_bytes * (int(seq_lens[r] > length) + written)
  n_tok = int(qsl[n_valid])
  per_token_in = sum(lay[n].shape[1] * item(lay[n]) for n in ("qkv", "b", "a"))
  per_token_out = lay["n_v"] * lay["d_v"] * item(qkv)
  return int(total + n_tok * (per_token_in + per_token_out))


def essential_flops(spec, chunk: int | None = None) -> int:
  """Matmul FLOPs a call cannot avoid: the chunked algorithm's at `chunk`
  (`workload.essential_flops`, 180,224 per token and value head at C = 64,
  K = V = 128; default `workload.FLOPS_CHUNK`) over the valid requests'
  tokens."""
  from tokamax_gdn.benchmarks import workload  # pylint: disable=g-import-not-at-top
  chunk = workload.FLOPS_CHUNK if chunk is None else chunk
  lay = arg_specs.layout_of(spec.name)
  qsl, dist = np.asarray(lay["query_start_loc"]), np.asarray(lay["distribution"])
  n_valid = min(int(dist[2]), lay["state_indices"].shape[0])
  tokens = int(qsl[n_valid] - qsl[0])
  shape = workload.LayerShape(b=1, t=tokens, hk=lay["n_kq"], hv=lay["n_v"], k=lay["d_k"],
                              v=lay["d_v"])
  return workload.essential_flops(shape, chunk, backward=False)


def loop_steps(spec) -> dict[str, int]:
  """How many times the `xla` implementation's loops run on the spec (heuristic config)."""
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import xla  # pylint: disable=g-import-not-at-top
  lay = arg_specs.layout_of(spec.name)
  qsl, dist = np.asarray(lay["query_start_loc"]), np.asarray(lay["distribution"])
  cfg = xla.heuristic_config(lay["qkv"].shape[0])
  n_valid = min(int(dist[2]), lay["state_indices"].shape[0])
  n_decode = min(int(dist[0]), n_valid)
  lengths = np.diff(qsl[:n_valid + 1])
  return dict(decode=-(-n_decode // cfg.decode_tile),
              prefill=int(sum(-(-int(n) // cfg.tile_size) for n in lengths[n_decode:])))


@dataclasses.dataclass
class Row:
  spec: str
  implementation: str
  compiled: str
  total_cycles: int | None = None
  kernels: dict[str, int] = dataclasses.field(default_factory=dict)
  hbm_bytes: int = 0
  floor_cycles: float | None = None
  total_over_floor: float | None = None
  loop_steps: dict[str, int] = dataclasses.field(default_factory=dict)


def report(target: str, specs, implementation: str, timeout: float | None = 1200) -> list[Row]:
  """One `Row` per spec (see the module docstring)."""
  gen = config.TPU_GENERATIONS[target]
  rows = []
  for spec in specs:
    (result,) = aot.compile_in_child(target, _BUILDER,
                                     dict(spec_name=spec.name, implementation=implementation),
                                     timeout=timeout)
    row = Row(spec.name, implementation, "ok" if result.report else (result.error or "?"),
              hbm_bytes=hbm_bytes(spec))
    if gen.hbm_bytes_per_cycle:
      row.floor_cycles = row.hbm_bytes / gen.hbm_bytes_per_cycle
    if result.report:
      for k, v in result.report.kernel_cycles.items():
        name = aot.kernel_name(k)
        row.kernels[name] = row.kernels.get(name, 0) + v
      row.total_cycles = sum(result.report.kernel_cycles.values())
      if row.floor_cycles:
        row.total_over_floor = row.total_cycles / row.floor_cycles
    if implementation == "xla":
      row.loop_steps = loop_steps(spec)
    rows.append(row)
  return rows


def as_dict(row: Row) -> dict[str, Any]:
  return dataclasses.asdict(row)
