"""Wall-clock tables on a TPU: ours beside the chip's floors and the peers
that run there, all measured in one run (`tokamax-gdn bench` on a TPU).

Every figure is the median of `n` timed calls after warm-up
(`timing.wall_ms`); every row carries its floor (`timing.Floors.floor_ms`:
essential MXU FLOPs or minimal HBM bytes at the rates this chip reached in the
same run) and its ratio to it. A peer that cannot run on this chip is a row
with the reason instead of a time, so a table says what was tried.

- `gdn_rows`: the gated delta rule as the GatedDeltaNet layer calls it
  (`workload.layer_fns`: [B, T, H D] q, k, v, the raw gate with a_log and
  dt_bias, beta's logits, q/k L2 norm), forward and training step (the value
  and gradients of `jnp.square(out).sum()`), per T; `fixed_cost` fits the
  per-call intercept over the lengths.
- `serving_rows`: the serving op on its named workloads, pools donated and
  fed back as an engine calls it: ms per call with N calls chained in one
  program (the headline), call by call, and the device time, against the
  workload's floor (essential FLOPs or HBM bytes at the chip's peaks), with
  the peers (tokamax's `xla` op, vLLM TPU's kernel, our vLLM drop-in);
  `chained_table` puts it one line per workload.
- `gmm_rows`: grouped matmuls at MoE shapes against a dense matmul of the
  same FLOPs and against `jax.lax.ragged_dot` / `tokamax.ragged_dot`.
"""

from collections.abc import Callable, Sequence
import dataclasses
import os
import time
import traceback
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from tokamax_gdn.benchmarks import timing
from tokamax_gdn.benchmarks import workload

PALLAS = "pallas_mosaic_tpu"
# Calls traced per profile (their events averaged).
PROFILE_CALLS = 3
KDA_XLA = "tokamax kda xla_chunked"
KDA_MOSAIC = "tokamax kda mosaic_tpu"


def _quiet(line: str) -> None:
  del line


def _done(row: dict[str, Any]) -> str:
  what = " ".join(str(row[k]) for k in ("op", "spec", "t", "impl", "pass_") if k in row)
  if not row.get("ms"):
    return f"{what}: {row.get('error')}"
  device = f" (device {row['device_ms']:.3f} ms)" if row.get("device_ms") is not None else ""
  chained = (f", chained {row['chained_ms']:.4f} ms per call"
             if row.get("chained_ms") is not None else "")
  error = f"; {row['error']}" if row.get("error") else ""
  return f"{what}: {row['ms']:.3f} ms{device}{chained}{error}"


def _error(e: BaseException) -> str:
  msg = f"{type(e).__name__}: {e}".replace("\n", " ")
  return msg[:300]


def _run(fn: Callable[[], float]) -> tuple[float | None, str | None]:
  try:
    return fn(), None
  except Exception as e:  # pylint: disable=broad-except
    return None, _error(e)


def _random_inputs(s: workload.LayerShape, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 7)
  abstract = workload.abstract_inputs(s)
  return [(jax.random.normal(k, a.shape, jnp.float32) * (0.5 if i >= 5 else 1.0)).astype(a.dtype)
          for i, (k, a) in enumerate(zip(keys, abstract))]


def _kda_fns(s: workload.LayerShape, implementation: str):
  """tokamax's kimi_delta_attention as a GDN peer: the raw gate broadcast over
  K, a_log [H] and dt_bias [H] repeated over K, so every channel of a head
  decays alike, as in GDN; q/k L2 norm. Its chunked XLA path needs its
  bounded gate form (`lower_bound`), which costs the same as GDN's. [H, B, T,
  D] arrays (its layout); forward and step."""
  from tokamax._src.ops.kda import api as kda_api  # pylint: disable=g-import-not-at-top

  def forward(q, k, v, g, beta, a_log, dt_bias):
    gate = jnp.broadcast_to(g[..., None], g.shape + (s.k,))
    out, _ = kda_api.kimi_delta_attention(
        q, k, v, gate, beta, a_log=a_log, delta_time_bias=jnp.repeat(dt_bias, s.k),
        use_qk_l2norm=True, use_gate_in_kernel=True, lower_bound=-5.0,
        implementation=implementation)
    return out

  def loss(*xs):
    return workload.step_loss(forward(*xs))

  return forward, jax.value_and_grad(loss, argnums=tuple(range(7)))


def _kda_inputs(s: workload.LayerShape, seed: int = 0):
  keys = jax.random.split(jax.random.key(seed), 7)
  hb = lambda d: (s.hv, s.b, s.t, d)
  q, k, v = (jax.random.normal(kk, hb(d), jnp.float32).astype(s.dtype)
             for kk, d in zip(keys, (s.k, s.k, s.v)))
  g = jax.random.normal(keys[3], (s.hv, s.b, s.t), jnp.float32).astype(s.dtype)
  beta = jax.nn.sigmoid(jax.random.normal(keys[4], (s.hv, s.b, s.t), jnp.float32))
  a_log = 0.5 * jax.random.normal(keys[5], (s.hv,), jnp.float32)
  dt_bias = 0.5 * jax.random.normal(keys[6], (s.hv,), jnp.float32)
  return q, k, v, g, beta.astype(s.dtype), a_log, dt_bias


def _compiled(fn, *args):
  start = time.perf_counter()
  c = jax.jit(fn).lower(*args).compile()
  return c, time.perf_counter() - start


def gdn_rows(floors: timing.Floors, shape: workload.LayerShape,
             lengths: Sequence[int] = (4096, 8192, 32768),
             impls: Sequence[str] = (PALLAS, "xla"), policies: Sequence[str] = ("save_gdn",),
             kda: bool = True, kda_max_t: int = 8192, n: int = 20,
             log: Callable[[str], None] = _quiet) -> list[dict[str, Any]]:
  """One row per (T, implementation, pass): ms, floor and ratio, MFU. `log`
  gets a line before each compile and after each row (a long compile on the
  chip says what it is)."""
  rows = []
  for t in lengths:
    s = dataclasses.replace(shape, t=t, flat=True)
    xs = _random_inputs(s)
    fwd_flops = workload.essential_flops(s, workload.FLOPS_CHUNK, backward=False)
    step_flops = workload.essential_flops(s, workload.FLOPS_CHUNK, backward=True)
    fwd_bytes = workload.min_hbm_bytes(s, backward=False)
    step_bytes = workload.min_hbm_bytes(s, backward=True)
    passes = []
    for impl in impls:
      fwd, step = workload.layer_fns(s, impl)
      passes += [(impl, "fwd", fwd, xs, fwd_flops, fwd_bytes),
                 (impl, "step", step, xs, step_flops, step_bytes)]
      if impl == PALLAS:
        for pol in policies:
          passes.append((impl, f"step {pol}", workload.layer_fns(s, impl, pol)[1], xs,
                         step_flops, step_bytes))
    if kda and t <= kda_max_t:
      kxs = _kda_inputs(s)
      for name, impl in ((KDA_XLA, "xla_chunked"), (KDA_MOSAIC, "mosaic")):
        fwd, step = _kda_fns(s, impl)
        passes += [(name, "fwd", fwd, kxs, fwd_flops, fwd_bytes),
                   (name, "step", step, kxs, step_flops, step_bytes)]
    for impl, pass_, fn, args, flops, hbm in passes:
      row = dict(table="gated_delta_rule", shape=str(s), t=t, impl=impl, pass_=pass_)
      log(f"gated_delta_rule T={t} {impl} {pass_}: compiling")
      try:
        compiled, secs = _compiled(fn, *args)
        ms = timing.wall_ms(compiled, *args, n=n)
        mem = compiled.memory_analysis()
        row.update(ms=ms, compile_s=secs,
                   temp_mib=getattr(mem, "temp_size_in_bytes", 0) / 2**20 if mem else None)
      except Exception as e:  # pylint: disable=broad-except
        row.update(ms=None, error=_error(e))
      floor = floors.floor_ms(flops, hbm)
      peak_floor = floors.floor_ms(flops, hbm, peak=True)
      row.update(floor_ms=floor, peak_floor_ms=peak_floor,
                 over_floor=row["ms"] / floor if row.get("ms") else None,
                 over_peak_floor=row["ms"] / peak_floor if row.get("ms") else None,
                 mfu=(flops / (row["ms"] / 1e3) / floors.peak_flops
                      if row.get("ms") and floors.peak_flops else None))
      rows.append(row)
      log(_done(row))
      del row
  return rows


def fixed_cost(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
  """Per (implementation, pass) with ≥ 2 lengths: the least-squares line
  ms = intercept + slope · T over the rows' lengths (the intercept is the
  per-call cost that does not scale with T)."""
  groups = {}
  for r in rows:
    if r.get("ms") is not None:
      groups.setdefault((r["impl"], r["pass_"]), []).append((r["t"], r["ms"]))
  out = []
  for (impl, pass_), pts in groups.items():
    if len(pts) < 2:
      continue
    t, ms = np.array(pts, np.float64).T
    slope, intercept = np.polyfit(t, ms, 1)
    out.append(dict(impl=impl, pass_=pass_, intercept_ms=float(intercept),
                    ms_per_4096_tokens=float(slope * 4096), lengths=[int(x) for x in t]))
  return out


def gdn_profile(shape: workload.LayerShape, t: int, impl: str = PALLAS,
                policy: str | None = None, top: int = 25) -> dict[str, Any]:
  """Device time per kernel and XLA op of one forward and one step at `t`."""
  s = dataclasses.replace(shape, t=t, flat=True)
  xs = _random_inputs(s)
  fwd, step = workload.layer_fns(s, impl, policy)
  out = {}
  for name, fn in (("fwd", fwd), ("step" if policy is None else f"step {policy}", step)):
    compiled, _ = _compiled(fn, *xs)
    wall = timing.wall_ms(compiled, *xs)
    events = timing.device_events(compiled, *xs, calls=PROFILE_CALLS)
    out[name] = dict(wall_ms=wall, device_ms=timing.busy_ms(events, PROFILE_CALLS, _is_ops_track),
                     ops=timing.op_table(events, PROFILE_CALLS)[:top])
  return out


def _is_ops_track(track: str) -> bool:
  """Device tracks of ops, not of the whole module or step markers."""
  return "XLA Ops" in track or track.endswith("Ops")


# ---------------------------------------------------------------------------
# Serving


def _compile_serving(spec_names: Sequence[str], impls: Sequence[str], workers: int,
                     log: Callable[[str], None], pool_layout: str = "auto",
                     chain: int = 0) -> dict[tuple[str, str, str], Any]:
  """Every program `serving_rows` times, compiled from abstract arguments (no
  device memory) in `workers` threads before any is timed: {(spec, impl,
  kind): future of (compiled, seconds)}, kind "step" (one call,
  `serving.jitted_step`) or, with `chain` > 0, "chained" (`chain` calls in one
  program, `serving.chained_program`). On the chip host the compiles were
  most of a serving bench's time, one after another while its other cores
  sat idle; timing after them all keeps the compiles off the host while the
  calls are timed."""
  import concurrent.futures  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import serving  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs  # pylint: disable=g-import-not-at-top

  def compile_one(spec_name, impl, kind):
    args, kwargs = arg_specs.by_name(spec_name).abstract()
    arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
    what = f"serving {spec_name} {impl}" + (f" x{chain} chained" if kind == "chained" else "")
    start = time.perf_counter()
    try:
      program = (serving.chained_program(impl, kwargs, chain, pool_layout) if kind == "chained"
                 else serving.jitted_step(impl, kwargs, pool_layout))
      compiled = program.lower(args[3], args[4], args[:3] + args[5:], arrays).compile()
    except Exception as e:
      log(f"{what}: compile failed ({_error(e)[:120]})")
      raise
    secs = time.perf_counter() - start
    log(f"{what}: compiled in {secs:.1f} s")
    return compiled, secs

  kinds = ("step", "chained") if chain else ("step",)
  jobs = [(s, i, k) for s in spec_names for i in impls for k in kinds]
  log(f"serving: compiling {len(jobs)} programs in {workers} threads")
  with concurrent.futures.ThreadPoolExecutor(max(1, workers)) as pool:
    out = {job: pool.submit(compile_one, *job) for job in jobs}
  return out


def _placed_pools(compiled, pools) -> list:
  """Copies of `pools` in the layouts `compiled` takes them in (a program
  that would relayout its pools on every call is refused: not a steady state
  to time). Copies: the program donates them, and the spec's pools serve the
  next program too."""
  formats = compiled.input_formats[0][:2]
  if jax.tree.leaves(compiled.output_formats)[:2] != list(formats):
    raise ValueError(f"pool layouts differ in and out of the call: {formats} vs"
                     f" {jax.tree.leaves(compiled.output_formats)[:2]}")
  return [tuple(jax.device_put(p.copy(), f) for p, f in zip(pools, formats))]


def headline_ms(row: dict[str, Any]) -> float | None:
  """A serving row's ms per call as an engine runs the op: the chained
  figure where there is one, else the call-by-call one."""
  return row["chained_ms"] if row.get("chained_ms") is not None else row.get("ms")


def serving_rows(floors: timing.Floors, spec_names: Sequence[str],
                 impls: Sequence[str] = (PALLAS, "xla"), tokamax: bool = True,
                 n: int = 20, log: Callable[[str], None] = _quiet, ops: int = 0,
                 compile_workers: int | None = None, pool_layout: str = "auto",
                 chain: int = 32,
                 on_row: Callable[[dict[str, Any]], None] | None = None
                 ) -> list[dict[str, Any]]:
  """One row per (workload, implementation), the pools donated and fed back
  from call to call as an engine calls the op (implementations: ours by
  name and `serving.PEERS`; `tokamax` appends tokamax's `xla` op):

  - `chained_ms` (with `chain` > 0): ms per call with `chain` calls chained in
    one program (`serving.chained_program`), the host's dispatch paid once
    per program: the headline figure. `loop_invariant`: the work XLA hoisted
    out of that program's loop (`serving.loop_invariant_ops`; empty is
    right, else the figure leaves that work out).
  - `ms`: ms per call, one program per call dispatched back to back
    (`timing.wall_ms`'s steady state): the host's dispatch of every call
    included, which is what a small call's figure then measures.
  - `device_ms`: the device ops' time of one call in a profile; with `ops` >
    0, `ops`: that profile's `ops` largest kernels and XLA ops
    (`timing.op_table`).
  - `floor_ms`: max(essential MXU FLOPs, minimal HBM bytes) at the chip's
    published peaks (`timing.Floors`, `peak=True`; the measured rates where
    no peak is known), `bound` the one that sets it: FLOPs of the chunked
    algorithm at C = 64 over the valid tokens (`serving_aot.essential_flops`),
    bytes of the states and tokens (`serving_aot.hbm_bytes`). `over_floor`:
    `headline_ms` / floor; `device_over_floor`: device_ms / floor.

  Every program is compiled first, in `compile_workers` threads (default:
  the host's cores less two, at most 8; `_compile_serving`): `compile_s` and
  `chain_compile_s` are each one's compile time beside the others'.
  `pool_layout` (`serving.POOL_LAYOUTS`): "auto", the pools placed once in
  the layouts XLA picks for each program (as an engine allocates them), or
  "default", the runtime's. `on_row(row)` is called after each row (a run
  cut short keeps what it measured)."""
  from tokamax_gdn.benchmarks import serving  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.aot import serving as serving_aot  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs  # pylint: disable=g-import-not-at-top
  # Here, not only in the compile threads, where an error becomes each row's.
  serving.check_pool_layout(pool_layout)
  if chain < 0:
    raise ValueError(f"chain must be >= 0; got {chain}")
  names = list(dict.fromkeys(list(impls) + ([serving.TOKAMAX] if tokamax else [])))
  if compile_workers is None:
    compile_workers = max(1, min(8, (os.cpu_count() or 1) - 2))
  programs = _compile_serving(spec_names, names, compile_workers, log, pool_layout, chain)
  rows = []
  for spec_name in spec_names:
    spec = arg_specs.by_name(spec_name)
    args, kwargs = spec.make(jax.random.key(0))
    arrays = {k: v for k, v in kwargs.items() if k not in arg_specs.STATIC}
    rest = args[:3] + args[5:]
    hbm = serving_aot.hbm_bytes(spec)
    flops = serving_aot.essential_flops(spec)
    floor = floors.floor_ms(flops, hbm, peak=True)
    for impl in names:
      row = dict(table="serving", spec=spec_name, shape=serving.describe(spec), impl=impl,
                 pool_layout=pool_layout, chain=chain, flops=flops, hbm_bytes=hbm,
                 floor_ms=floor, bound=floors.bound(flops, hbm, peak=True))
      try:
        compiled, row["compile_s"] = programs[spec_name, impl, "step"].result()
        state = _placed_pools(compiled, args[3:5])

        def call():
          state[0], out = compiled(*state[0], rest, arrays)
          return state[0], out

        row["ms"] = timing.wall_ms(call, n=n)
        # A small decode's call-by-call figure can be the host's dispatch of
        # the call, not the chip: the profile's device time says which.
        events = timing.device_events(call, calls=PROFILE_CALLS)
        row["device_ms"] = timing.busy_ms(events, PROFILE_CALLS, _is_ops_track)
        row["device_over_floor"] = row["device_ms"] / floor
        if ops:
          row["ops"] = timing.op_table(events, PROFILE_CALLS)[:ops]
        del state
        if chain:
          chained, row["chain_compile_s"] = programs[spec_name, impl, "chained"].result()
          try:
            row["loop_invariant"] = serving.loop_invariant_ops(chained.as_text())
          except Exception as e:  # pylint: disable=broad-except
            # (The figure stands; only the check is missing.)
            row["loop_invariant"] = [f"HLO not read: {_error(e)[:100]}"]
          state = _placed_pools(chained, args[3:5])

          def chained_call():
            state[0], out = chained(*state[0], rest, arrays)
            return state[0], out

          # Few programs: each is `chain` calls already.
          row["chained_ms"] = timing.wall_ms(chained_call, n=max(2, n // 4)) / chain
          del state
        row["over_floor"] = headline_ms(row) / floor
      except Exception as e:  # pylint: disable=broad-except
        row.update(error=_error(e))
        row.setdefault("ms", None)
      rows.append(row)
      log(_done(row))
      if on_row:
        on_row(row)
  return rows


def chained_table(rows: Sequence[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, str]]:
  """`serving_rows`' rows as one line per workload: its floor and what sets
  it, each implementation's `headline_ms` (in the rows' order; "failed"
  where it has none, the rows say why), and the first implementation's
  ratio to the floor. (rows, columns) for `common.print_table` /
  `record.write_section`."""
  impls = list(dict.fromkeys(r["impl"] for r in rows))
  out = []
  for spec in dict.fromkeys(r["spec"] for r in rows):
    mine = {r["impl"]: r for r in rows if r["spec"] == spec}
    first = mine[impls[0]] if impls[0] in mine else {}
    line = dict(spec=spec, floor_ms=next(iter(mine.values()))["floor_ms"],
                bound=next(iter(mine.values())).get("bound"),
                over_floor=first.get("over_floor"))
    for i in impls:
      ms = headline_ms(mine[i]) if i in mine else None
      line[f"ms:{i}"] = "failed" if ms is None and i in mine else ms
    out.append(line)
  columns = dict(spec="workload", floor_ms="floor ms", bound="bound")
  for k, i in enumerate(impls):
    columns[f"ms:{i}"] = i
    if k == 0:
      columns["over_floor"] = "x floor"
  return out, columns


def mixed_vs_parts(floors: timing.Floors, rows: Sequence[dict[str, Any]],
                   parts: dict[str, Sequence[str]], n: int = 20,
                   log: Callable[[str], None] = _quiet,
                   pool_layout: str = "auto", chain: int = 32) -> list[dict[str, Any]]:
  """For each mixed workload among `rows` (`serving_rows`' output) that
  `parts` lists: the mixed call's time against the sum of its parts run as
  separate calls (`serving_rows` of the parts, same `chain`), per
  implementation of ours (the peers are left out: this asks whether our
  mixed calls cost more than their parts). A ratio at or below 1 means
  mixing costs nothing. Times: `headline_ms`."""
  from tokamax_gdn.benchmarks import serving  # pylint: disable=g-import-not-at-top
  out = []
  for mixed in dict.fromkeys(r["spec"] for r in rows if r["spec"] in parts):
    impls = [r["impl"] for r in rows if r["spec"] == mixed and r["impl"] not in serving.PEERS]
    if not impls:
      continue
    part_rows = serving_rows(floors, list(dict.fromkeys(parts[mixed])), impls, tokamax=False,
                             n=n, log=log, pool_layout=pool_layout, chain=chain)
    for impl in impls:
      [m] = [r for r in rows if r["spec"] == mixed and r["impl"] == impl]
      ms = {r["spec"]: headline_ms(r) for r in part_rows if r["impl"] == impl}
      total = (sum(ms[p] for p in parts[mixed])
               if all(ms.get(p) is not None for p in parts[mixed]) else None)
      mixed_ms = headline_ms(m)
      out.append(dict(table="mixed", spec=mixed, impl=impl, ms=mixed_ms,
                      parts=" + ".join(parts[mixed]), parts_ms=total,
                      over_parts=mixed_ms / total if total and mixed_ms else None))
  return out


# ---------------------------------------------------------------------------
# Grouped matmuls


GMM_SHAPES = ((16384, 2048, 512, 64), (16384, 512, 2048, 64))


def gmm_rows(floors: timing.Floors, shapes=GMM_SHAPES, n: int = 20,
             log: Callable[[str], None] = _quiet) -> list[dict[str, Any]]:
  """gmm and tgmm (bf16, multinomial group sizes) beside a dense matmul of the
  same FLOPs, `jax.lax.ragged_dot` and `tokamax.ragged_dot`.

  The floor is the larger of the MXU time and the HBM time of the minimal
  bytes: every group's weights (gmm's rhs, tgmm's output) read or written
  once, plus the activations. With many experts the weights dominate, so
  the dense matmul (one expert's weights) is not a reachable bar there."""
  import tokamax  # pylint: disable=g-import-not-at-top
  import tokamax_gdn  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.gmm import arg_specs as gmm_specs  # pylint: disable=g-import-not-at-top
  rows = []
  for m, k, n_, g in shapes:
    key = jax.random.key(m + k + n_ + g)
    k1, k2, k3, k4 = jax.random.split(key, 4)
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(k2, (g, k, n_), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
    dout = jax.random.normal(k4, (m, n_), jnp.float32).astype(jnp.bfloat16)
    sizes = gmm_specs.random_group_sizes(k3, g=g, total=m)
    flops = 2 * m * k * n_
    # lhs, the groups' weights and the [M, N] side, bf16 (tgmm: the same
    # three arrays, the weights as its output).
    hbm = 2 * (m * k + g * k * n_ + m * n_)
    shape = f"M{m} K{k} N{n_} G{g} bf16"
    dense_ms, _ = _run(lambda: timing.wall_ms(jax.jit(lambda a, b: a @ b), lhs, rhs[0], n=n))
    dense_t_ms, _ = _run(lambda: timing.wall_ms(jax.jit(lambda a, b: a.T @ b), lhs, dout, n=n))
    cands = [
        ("gmm", "dense matmul", lambda: dense_ms),
        ("gmm", f"ours {PALLAS}", lambda: timing.wall_ms(
            jax.jit(lambda a, b, s: tokamax_gdn.gmm(a, b, s, implementation=PALLAS)),
            lhs, rhs, sizes, n=n)),
        ("gmm", "ours xla", lambda: timing.wall_ms(
            jax.jit(lambda a, b, s: tokamax_gdn.gmm(a, b, s, implementation="xla")),
            lhs, rhs, sizes, n=n)),
        ("gmm", "jax.lax.ragged_dot", lambda: timing.wall_ms(
            jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s)), lhs, rhs, sizes, n=n)),
        ("gmm", "tokamax.ragged_dot", lambda: timing.wall_ms(
            jax.jit(lambda a, b, s: tokamax.ragged_dot(a, b, s)), lhs, rhs, sizes, n=n)),
        ("tgmm", "dense matmul", lambda: dense_t_ms),
        ("tgmm", f"ours {PALLAS}", lambda: timing.wall_ms(
            jax.jit(lambda a, b, s: tokamax_gdn.tgmm(a, b, s, implementation=PALLAS)),
            lhs, dout, sizes, n=n)),
        ("tgmm", "ours xla", lambda: timing.wall_ms(
            jax.jit(lambda a, b, s: tokamax_gdn.tgmm(a, b, s, implementation="xla")),
            lhs, dout, sizes, n=n)),
    ]
    for op, impl, fn in cands:
      log(f"{op} {shape} {impl}: compiling")
      ms, err = _run(fn)
      dense = dense_ms if op == "gmm" else dense_t_ms
      floor = floors.floor_ms(flops, hbm)
      rows.append(dict(table="gmm", op=op, shape=shape, impl=impl, ms=ms, error=err,
                       floor_ms=floor, hbm_bytes=hbm, over_floor=ms / floor if ms else None,
                       pct_of_dense=100 * dense / ms if ms and dense else None))
      log(_done(rows[-1]))
  return rows


def traceback_text() -> str:
  return traceback.format_exc()[-2000:]
