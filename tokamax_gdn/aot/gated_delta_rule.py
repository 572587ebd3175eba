"""Static TPU report of the Pallas gated delta rule, compiled on CPU (`tokamax-gdn aot`).

For one layer call (`benchmarks.workload`) and one TPU generation,
per pass (forward; forward+backward, the gradient of `workload.step_loss`,
sum(out²), which keeps the forward kernel in the program as a training step does):
- memory: temp / argument / output bytes;
- cycles: the compiler's static estimate per Pallas kernel (names `gdn_*`), the
  XLA glue around them summed, and the total;
- roofline: the floor max(MXU floor, HBM floor) of the shape (essential FLOPs
  over the generation's peak FLOP/cycle, minimal HBM bytes over its bytes per
  cycle, both on the estimator's scale, see `tokamax_gdn.aot`) and the total
  over that floor.

The cycle dump at the full length is slow, so each pass is compiled once,
with the dump on, at a short length (512 by default) in a child process, and
its cycles are scaled to T: every kernel's work grows linearly in T, plus a
small fixed part per call, which one length scales with the rest (5 % high
from 512 to 2048 at Hk=2 Hv=4); two lengths extrapolate along the line through
them (`tests/aot_test.py` checks this against a direct estimate), and the
report gives the ratio of their totals. Memory comes from a compile at T
itself, unless `full_length_memory=False`, which scales it too: temporaries
do not grow linearly from short lengths, where XLA keeps more in VMEM
(Qwen3-Next fwd+bwd on v6e: 18.5 MiB scaled from 512 vs 172 MiB at 4096). With
`kda=True` tokamax's `kimi_delta_attention` (mosaic, the scalar gate broadcast
over K, q/k repeated to Hv heads: it has no GVA) is compiled on the same
shapes for comparison.
"""

from collections.abc import Sequence
import concurrent.futures
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from tokamax_gdn import aot
from tokamax_gdn import registry
from tokamax_gdn.benchmarks import workload

GDN = "gdn pallas_mosaic_tpu"
KDA = "tokamax kda mosaic_tpu"
PASSES = ("fwd", "fwd+bwd")
GLUE = "(xla glue, summed)"


def _kda_fns(k_dim: int):
  """tokamax KDA (mosaic) forward and fwd+bwd on [H, B, T, D] arguments."""
  from tokamax._src.ops.kda import api as kda_api  # pylint: disable=g-import-not-at-top

  def forward(q, k, v, g, beta):
    gate = jnp.broadcast_to(g[..., None], g.shape + (k_dim,))
    out, _ = kda_api.kimi_delta_attention(q, k, v, gate, beta, implementation="mosaic")
    return out

  def loss(*xs):
    return workload.step_loss(forward(*xs))

  return forward, jax.grad(loss, argnums=tuple(range(5)))


def remat_pass(policy: str) -> str:
  """The pass name of fwd+bwd under `jax.checkpoint` with a remat policy."""
  return f"fwd+bwd/{policy}"


def _layer_call(shape: dict[str, Any]) -> workload.LayerShape:
  """`shape` (LayerShape fields) as the layer calls the op: q, k, v and the
  output as [B, T, H D] (`LayerShape.flat`), in every builder here."""
  return dataclasses.replace(workload.LayerShape(**shape), flat=True)


def _gdn_fn(pass_: str, s: workload.LayerShape):
  """The layer's call for `pass_` on `workload.abstract_inputs(s)` (`s.flat`:
  q, k, v as the layer's projections make them), compiled with
  `Layout.AUTO` arguments and results (`aot.compile_for`'s
  `aot_auto_layouts`).

  In a model the gate and beta come from the input projection's fusions,
  written in the layout the kernels read, and their gradients go to its
  weight-gradient matmul; a jit of the bare call on [B, T, Hv] parameters
  instead gets T-minor layouts for them, and XLA relayouts g and beta in and
  dg and dbeta out (the compiled GatedDeltaNet layer has no such copies).
  """
  if pass_ == "fwd":
    fn = workload.layer_fns(s, "pallas_mosaic_tpu")[0]
  else:
    policy = pass_.split("/", 1)[1] if "/" in pass_ else None
    fn = workload.layer_fns(s, "pallas_mosaic_tpu", policy)[1]

  def call(*args):
    return fn(*args)

  call.aot_auto_layouts = True
  return call


def cases(mesh: Mesh, shape: dict[str, Any], kda: bool = False,
          passes: Sequence[str] = PASSES) -> list[aot.Case]:
  """AOT cases "<impl>|<pass>" for `shape` (LayerShape fields; dtype by name).

  Passes: "fwd", "fwd+bwd", and `remat_pass(policy)` (GDN only)."""
  s = _layer_call(shape)
  rep = NamedSharding(mesh, P())
  out = [(f"{GDN}|{p}", _gdn_fn(p, s), workload.abstract_inputs(s, rep))
         for p in passes]
  passes = [p for p in passes if p in PASSES]
  if kda:
    sds = lambda *dims: jax.ShapeDtypeStruct((s.hv, s.b, s.t) + dims, s.dtype, sharding=rep)
    kda_args = (sds(s.k), sds(s.k), sds(s.v), sds(), sds())
    kda_fns = dict(zip(PASSES, _kda_fns(s.k)))
    out += [(f"{KDA}|{p}", kda_fns[p], kda_args) for p in passes]
  return out


def cycle_cases(mesh: Mesh, shape: dict[str, Any], lengths: Sequence[int], kda: bool = False,
                passes: Sequence[str] = PASSES) -> list[aot.Case]:
  """`cases` at each length in `lengths`, labelled "<impl>|<pass>|<T>"."""
  out = []
  for t in lengths:
    for label, fn, args in cases(mesh, dict(shape, t=t), kda, passes):
      out.append((f"{label}|{t}", fn, args))
  return out


def _is_pallas(impl: str, name: str) -> bool:
  if impl == GDN:
    return name.startswith("gdn_")
  return "kda" in name.lower() or "chunk" in name.lower()


def split_cycles(impl: str, kernel_cycles: dict[str, int]) -> dict[str, int]:
  """Pallas kernels by name (estimates of repeated calls summed) + the glue summed."""
  out, glue = {}, 0
  for dump_name, cyc in kernel_cycles.items():
    name = aot.kernel_name(dump_name)
    if _is_pallas(impl, name):
      out[name] = out.get(name, 0) + cyc
    else:
      glue += cyc
  out[GLUE] = glue
  return out


def extrapolate(values: Sequence[float], lengths: Sequence[int], t: int) -> float:
  """The value at t: proportional to t from one length, else on the line
  through the first and last (length, value)."""
  if len(lengths) == 1:
    return values[0] * t / lengths[0]
  (t1, c1), (t2, c2) = (lengths[0], values[0]), (lengths[-1], values[-1])
  return c2 + (c2 - c1) * (t - t2) / (t2 - t1)


def _chunk_size(s: workload.LayerShape, mesh: Mesh) -> int:
  """The chunk the Pallas forward uses for `s` (its config from the cache or heuristics)."""
  op = registry.get("gated_delta_rule", "pallas_mosaic_tpu")
  args = workload.abstract_inputs(dataclasses.replace(s, flat=False))
  with aot.on_target(mesh):
    cfg = op.bind(*args[:5], a_log=args[5], dt_bias=args[6], use_qk_l2norm=True).default_config
  return int(getattr(cfg, "chunk_size", 64))


@dataclasses.dataclass
class PassReport:
  """One (implementation, pass): memory and cycles at T, roofline."""

  impl: str
  pass_: str
  compiled: str                      # "ok" or the compile error
  memory_from: str = ""              # "T=<full>" or "T=<short> scaled"
  temp_bytes: int | None = None
  host_temp_bytes: int | None = None  # offloaded to host (remat policies)
  argument_bytes: int | None = None
  output_bytes: int | None = None
  kernels: dict[str, int] = dataclasses.field(default_factory=dict)  # incl. GLUE
  total_cycles: int | None = None
  scaling: float | None = None       # total at the last length over the first
  flops: int | None = None
  hbm_bytes: int | None = None
  mxu_cycles: float | None = None
  hbm_cycles: float | None = None
  floor_cycles: float | None = None
  total_over_floor: float | None = None
  note: str = ""
  # Kernel -> `aot.bundle_units` at the first cycle length (`report(units=True)`).
  units: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


_CYCLE_BUILDER = "tokamax_gdn.aot.gated_delta_rule:cycle_cases"


def report(target: str, s: workload.LayerShape, *, kda: bool = False,
           cycle_lengths: Sequence[int] = (512,), full_length_memory: bool = True,
           remat_policies: Sequence[str] = (),
           timeout: float | None = 900, units: bool = False) -> list[PassReport]:
  """Compiles and estimates every pass; see the module docstring.

  Each (implementation, pass) is compiled with the cycle dump on in a child
  process of its own (two at a time), at each of `cycle_lengths` (capped at
  T); cycles, and memory unless `full_length_memory`, are scaled from there
  to T (`extrapolate`). A pass whose child has no report (a libtpu abort) and
  every pass with `full_length_memory` get a compile at T in this process for
  their memory. Empty `cycle_lengths`: memory at T only. `remat_policies`
  add one fwd+bwd pass each under `jax.checkpoint` with that policy
  (`workload.layer_fns`), with the bytes it offloads to host memory. A
  GDN fwd or fwd+bwd pass whose estimate fails (tpu7x's fwd+bwd: the cycle
  dump's VMEM reservation overflows the chip) gets its kernels' cycles from
  compiles of each kernel alone (`_kernels_alone`; glue not estimated).
  `units`: each kernel's VLIW slot use at the first cycle length too
  (`aot.bundle_units`; libtpu's LLO text dump, much slower).
  """
  lengths = sorted({min(t, s.t) for t in cycle_lengths})
  shape = dict(dataclasses.asdict(s), dtype=jnp.dtype(s.dtype).name)
  mesh = aot.target_mesh(target)
  passes = list(PASSES) + [remat_pass(p) for p in remat_policies]
  labels = [label for label, _, _ in cases(mesh, shape, kda, passes)]
  estimates: dict[str, list[aot.ChildResult]] = {}
  if lengths:
    def in_child(label):
      impl, pass_ = label.split("|")
      return aot.compile_in_child(
          target, _CYCLE_BUILDER, dict(shape=shape, lengths=lengths, kda=impl == KDA,
                                       passes=[pass_]), timeout=timeout, units=units)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
      for label, results in zip(labels, pool.map(in_child, labels)):
        estimates[label] = [r for r in results if r.label.startswith(label + "|")]
  chunk = _chunk_size(s, mesh)
  reports = []
  for label, fn, args in cases(mesh, shape, kda, passes):
    impl, pass_ = label.split("|")
    r = PassReport(impl, pass_, "ok")
    reports.append(r)
    est = estimates.get(label, [])
    if est and all(e.report for e in est):
      split = [split_cycles(impl, e.report.kernel_cycles) for e in est]
      names = sorted(set().union(*split), key=lambda n: (n == GLUE, n))
      r.kernels = {n: round(extrapolate([x.get(n, 0) for x in split], lengths, s.t))
                   for n in names}
      r.total_cycles = sum(r.kernels.values())
      r.units = est[0].report.kernel_units
      totals = [sum(x.values()) for x in split]
      r.scaling = totals[-1] / totals[0] if len(lengths) > 1 and totals[0] else None
      if not full_length_memory:
        for field in ("temp_bytes", "host_temp_bytes", "argument_bytes", "output_bytes"):
          values = [getattr(e.report, field) for e in est]
          setattr(r, field, round(extrapolate(values, lengths, s.t)))
        r.memory_from = f"T={lengths} scaled"
    elif lengths:
      errors = {e.error for e in est if e.error} or {"not compiled"}
      r.note = "no cycle estimate: " + "; ".join(sorted(errors))[:300]
      if impl == GDN and pass_ in PASSES:
        _kernels_alone(r, target, shape, lengths, s.t, timeout)
    if r.memory_from == "":
      try:
        rep = aot.compile_for(target, fn, *args, mesh=mesh)
        r.temp_bytes, r.argument_bytes, r.output_bytes = (
            rep.temp_bytes, rep.argument_bytes, rep.output_bytes)
        r.host_temp_bytes = rep.host_temp_bytes
        r.memory_from = f"T={s.t}"
      except Exception as e:  # pylint: disable=broad-exception-caught
        r.compiled = f"FAIL: {str(e).splitlines()[0][:160]}"
    if impl == GDN:
      backward = pass_.startswith("fwd+bwd")
      r.flops = workload.essential_flops(s, chunk, backward=backward)
      r.hbm_bytes = workload.min_hbm_bytes(s, backward=backward)
      floor = aot.roofline_cycles(target, r.flops, r.hbm_bytes)
      r.mxu_cycles, r.hbm_cycles = floor["mxu_cycles"], floor["hbm_cycles"]
      r.floor_cycles = floor["floor_cycles"]
      if r.total_cycles:
        r.total_over_floor = r.total_cycles / r.floor_cycles
  return reports


# A scoped-VMEM limit at which each GDN kernel compiles alone with the cycle
# dump's reservation beside it (tpu7x, Qwen3-Next heads: the backward
# overflows at its own 21 MiB limit, 65.3 of 63.9 MiB at T=512; 19 fits).
KERNELS_ALONE_VMEM_MIB = 19
_KERNELS_OF_PASS = {"fwd": ("gdn_fwd",), "fwd+bwd": ("gdn_fwd", "gdn_fwd_states", "gdn_bwd")}


def _kernels_alone(r: PassReport, target: str, shape: dict[str, Any], lengths: Sequence[int],
                   t: int, timeout: float | None) -> None:
  """`r`'s kernels from `kernel_cases` (each compiled alone at
  `KERNELS_ALONE_VMEM_MIB`, at each of `lengths`, scaled to `t`), where the
  pass's own cycle estimate failed: per-kernel cycles from the target's own
  estimator, the glue not estimated (the total is the kernels' sum, a lower
  bound)."""
  per_length = []
  for length in lengths:
    results = aot.compile_in_child(target, _KERNELS_BUILDER,
                                   dict(shape=dict(shape, t=length),
                                        vmem_limit_mib=KERNELS_ALONE_VMEM_MIB),
                                   timeout=timeout)
    cycles = {}
    for res in results:
      name = res.label.split()[0]
      if name not in _KERNELS_OF_PASS[r.pass_]:
        continue
      if res.report is None:
        r.note += f"; {name} alone: {res.error}"[:200]
        return
      cycles[name] = split_cycles(GDN, res.report.kernel_cycles).get(name, 0)
    per_length.append(cycles)
  r.kernels = {n: round(extrapolate([c[n] for c in per_length], lengths, t))
               for n in _KERNELS_OF_PASS[r.pass_]}
  r.total_cycles = sum(r.kernels.values())
  # Short enough for the record's 100-character note column (cli/aot.py).
  r.note = (f"kernels alone at {KERNELS_ALONE_VMEM_MIB} MiB scoped VMEM (pass estimate failed);"
            " glue not estimated, total = kernels")


# ------------------------------------------------------------ kernels alone
_KERNELS_BUILDER = "tokamax_gdn.aot.gated_delta_rule:kernel_cases"


def kernel_cases(mesh: Mesh, shape: dict[str, Any],
                 vmem_limit_mib: int | None = None) -> list[aot.Case]:
  """The three GDN kernels of a training step, each compiled alone ("gdn_fwd",
  "gdn_fwd_states", "gdn_bwd" with its residuals as inputs), on the raw
  inputs of the layer's call (the prologue and the NaN guard in the kernels,
  as the op runs them), with the configs the op picks for `shape`. q, k, v,
  dO and the per-head results are [B, T, H D] arguments and results, as in
  the layer (`workload.LayerShape.flat`): as [B, T, H, D] ones XLA
  copies them into the kernels' layout, and at T=512 it keeps those copies
  in VMEM, which took tpu7x's backward past its VMEM here.

  For per-kernel cycles where the whole step's estimate does not compile:
  with the cycle dump on, XLA reserves VMEM of its own next to the kernel
  (`aot.enable_cycle_estimates`), and tpu7x's backward at its 21 MiB scoped
  limit then overflows (65.3 of 63.9 MiB at T=512). `vmem_limit_mib` lowers
  every kernel's scoped limit (19 fits there); it bounds the kernel's VMEM,
  it does not change its code, so the estimate is the kernel's own.
  """
  from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu as pallas  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_kernel as kernel  # pylint: disable=g-import-not-at-top
  s = _layer_call(shape)
  args = workload.abstract_inputs(dataclasses.replace(s, flat=False))
  op = registry.get("gated_delta_rule", "pallas_mosaic_tpu")
  with aot.on_target(mesh):
    ba = op.bind(*args[:5], a_log=args[5], dt_bias=args[6], use_qk_l2norm=True,
                 use_beta_sigmoid=True)
    fwd_cfg = ba.default_config
    bwd_cfg = pallas.backward_config(ba)
    states_cfg = pallas.states_pass_config(bwd_cfg, ba)
  raw = list(workload.abstract_inputs(s, NamedSharding(mesh, P())))   # the layer's call
  sds = lambda dims, dtype: aot.spec(mesh, dims, dtype)
  scale = s.k ** -0.5

  def kwargs(cfg, kind):
    with aot.on_target(mesh):
      out = pallas.kernel_keywords(cfg, *args[:3:2], kind)
    if vmem_limit_mib:
      out["vmem_limit_bytes"] = vmem_limit_mib << 20
    return out

  pro = lambda a_log, dt_bias: kernel.Prologue(
      qk_l2norm=True, a_log=a_log, dt_bias=dt_bias, log_decay_floor=op.log_decay_floor,
      beta_sigmoid=True)
  heads = lambda q, k, v: (workload.split_heads(q, s.k), workload.split_heads(k, s.k),
                           workload.split_heads(v, s.v))

  def fwd(q, k, v, g, beta, a_log, dt_bias):
    out, _, _ = kernel.gdn_fwd(*heads(q, k, v), g, beta, scale=scale, final_state=False,
                               pro=pro(a_log, dt_bias), guard=True, **kwargs(fwd_cfg, "fwd"))
    return workload.merge_heads(out)

  def states_pass(q, k, v, g, beta, a_log, dt_bias):
    return kernel.gdn_fwd(*heads(q, k, v), g, beta, scale=scale,
                          write_out=False, emit_residuals=True, final_state=False, guard=True,
                          pro=pro(a_log, dt_bias), **kwargs(states_cfg, "states"))[2]

  def bwd(q, k, v, g, beta, a_log, dt_bias, d_out, states, tmats, flags):
    grads = kernel.gdn_bwd(*heads(q, k, v), g, beta, workload.split_heads(d_out, s.v), None,
                           scale=scale, residuals=(states, tmats, flags), guard=True,
                           pro=pro(a_log, dt_bias), **kwargs(bwd_cfg, "bwd"))
    return tuple(map(workload.merge_heads, grads[:3])) + tuple(grads[3:])

  # The backward's residual inputs (states, T', the guard's forward flags)
  # as the states pass gives them on this target: their shapes stated once,
  # by the kernel wrapper.
  with aot.on_target(mesh):
    residuals = [sds(x.shape, x.dtype) for x in jax.eval_shape(states_pass, *raw)]
  label = lambda name, cfg: f"{name} C={cfg.chunk_size} interleave={cfg.interleave}"
  return [(label("gdn_fwd", fwd_cfg), fwd, raw),
          (label("gdn_fwd_states", states_cfg), states_pass, raw),
          (label("gdn_bwd", bwd_cfg), bwd, raw + [raw[2], *residuals])]


# ------------------------------------------------------------ heads over devices
def sharded_cases(mesh: Mesh, shape: dict[str, Any],
                  passes: Sequence[str] = PASSES) -> list[aot.Case]:
  """The layer's call with its heads split over `mesh`'s "x" devices by
  `jax.shard_map` (each device: Hk/n key heads with their value heads), as a
  user on one tpu7x chip runs it over the chip's two devices (JAX exposes
  each TensorCore as a device; a "parallel" grid axis never splits across
  them). The compiled program is one device's: its memory and cycles are
  per device. fwd+bwd: value and gradients of `workload.step_loss`, the loss
  summed over the devices."""
  s = _layer_call(shape)
  n = mesh.devices.size
  if s.hk % n:
    raise ValueError(f"{s.hk} key heads do not split over {n} devices")
  heads, vec = P(None, None, "x"), P("x")
  in_specs = (heads,) * 5 + (vec, vec)
  forward, step = workload.layer_fns(s, "pallas_mosaic_tpu")

  def local_step(*xs):
    loss, grads = step(*xs)
    return jax.lax.psum(loss, "x"), grads

  fns = {"fwd": jax.shard_map(forward, mesh=mesh, in_specs=in_specs, out_specs=heads,
                              check_vma=False),
         "fwd+bwd": jax.shard_map(local_step, mesh=mesh, in_specs=in_specs,
                                  out_specs=(P(), in_specs), check_vma=False)}
  args = [aot.spec(mesh, x.shape, x.dtype, spec)
          for x, spec in zip(workload.abstract_inputs(s), in_specs)]
  return [(f"{GDN}|{p}|{n} devices", fns[p], args) for p in passes]
