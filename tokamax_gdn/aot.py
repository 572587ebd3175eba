"""Compile for a real TPU generation on a CPU-only machine (through libtpu).

`compile_for(target, fn, *arg_specs)` lowers and compiles `fn` for one chip
of the target's topology, which runs Mosaic's real passes: bad block shapes,
layouts and VMEM overflow fail here as they would on the chip. The report has
the compiled memory sizes and, per Pallas kernel, the compiler's static cycle
estimate (the static LLO profile; 0 or absent for kernels with inner
pipelines, where the compiler gives none).

The cycle dump is configured through LIBTPU_INIT_ARGS, which libtpu reads once
per process: `enable_cycle_estimates()` must run before the first topology is
made (the CLI does this; tests that only need compile/memory don't).
"""

from collections.abc import Callable, Sequence
import contextlib
import dataclasses
import functools
import glob
import os
import re
import shutil
import tempfile
from typing import Any

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # pylint: disable=g-import-not-at-top
from jax.experimental import topologies  # pylint: disable=g-import-not-at-top
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
from tokamax import config as tokamax_config  # pylint: disable=g-import-not-at-top

from tokamax_gdn import config  # pylint: disable=g-import-not-at-top

_DUMP_FLAG = "--xla_jf_dump_static_llo_profile_to="
_cycle_dir: str | None = None


def enable_cycle_estimates(dump_dir: str | None = None) -> str | None:
  """Asks libtpu to dump static cycle estimates; call before any compile.

  Returns the dump folder, or None if libtpu was already initialised without
  it in this process (then `CompileReport.kernel_cycles` stays empty).
  """
  global _cycle_dir
  if _cycle_dir is not None:
    return _cycle_dir
  args = os.environ.get("LIBTPU_INIT_ARGS", "")
  if _DUMP_FLAG in args:
    _cycle_dir = args.split(_DUMP_FLAG, 1)[1].split()[0]
    return _cycle_dir
  if _topology.cache_info().currsize:
    return None
  _cycle_dir = dump_dir or tempfile.mkdtemp(prefix="tokamax_gdn_llo_")
  os.environ["LIBTPU_INIT_ARGS"] = f"{args} {_DUMP_FLAG}{_cycle_dir}".strip()
  return _cycle_dir


@functools.lru_cache(maxsize=None)
def _topology(target: str):
  gen = config.TPU_GENERATIONS[target]
  return topologies.get_topology_desc(topology_name=gen.topology, platform="tpu")


def target_mesh(target: str, num_devices: int = 1, axis_names: Sequence[str] = ("x",),
                shape: Sequence[int] | None = None) -> Mesh:
  """A mesh over `num_devices` chips of `target` (v5e, v6e, v5p, tpu7x)."""
  if target not in config.TPU_GENERATIONS:
    raise ValueError(f"Unknown target {target!r}; valid: {sorted(config.TPU_GENERATIONS)}")
  devices = _topology(target).devices
  if num_devices > len(devices):
    raise ValueError(f"{target} topology has {len(devices)} devices, asked for {num_devices}")
  shape = tuple(shape) if shape is not None else (num_devices,)
  return Mesh(np.array(devices[:num_devices]).reshape(shape), tuple(axis_names))


def spec(mesh: Mesh, shape: Sequence[int], dtype, pspec: P = P()) -> jax.ShapeDtypeStruct:
  """An abstract argument placed on `mesh` with partition spec `pspec`."""
  return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, pspec))


@dataclasses.dataclass
class CompileReport:
  """What one AOT compile tells: memory sizes and per-kernel cycle estimates."""

  target: str
  temp_bytes: int
  argument_bytes: int
  output_bytes: int
  kernel_cycles: dict[str, int]

  def as_row(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _snapshot(d: str | None) -> set[str]:
  if not d or not os.path.isdir(d):
    return set()
  return set(glob.glob(os.path.join(d, "*static_llo_profile*")))


def _read_cycles(paths: set[str]) -> dict[str, int]:
  out = {}
  for p in sorted(paths):
    with open(p) as f:
      text = f.read()
    m = re.search(r"estimated_cycles:\s*(\d+)", text)
    name = os.path.basename(p).split("_static_llo_profile")[0]
    out[name] = int(m.group(1)) if m else 0
  return out


@contextlib.contextmanager
def on_target(mesh: Mesh):
  """Abstract mesh (so ops see the chip) + tokamax cross-compilation."""
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), tokamax_config.cross_compile(True):
    yield


def compile_for(target: str, fn: Callable[..., Any], *arg_specs,
                mesh: Mesh | None = None, **static_kwargs) -> CompileReport:
  """Compiles `fn(*arg_specs, **static_kwargs)` for `target`; raises on failure.

  `arg_specs` are `jax.ShapeDtypeStruct`s, typically from `spec(mesh, ...)`;
  plain (shape, dtype) tuples are placed replicated on one chip.
  """
  mesh = mesh or target_mesh(target)
  args = [a if isinstance(a, jax.ShapeDtypeStruct) else spec(mesh, *a) for a in arg_specs]
  before = _snapshot(_cycle_dir)
  with on_target(mesh):
    compiled = jax.jit(functools.partial(fn, **static_kwargs)).lower(*args).compile()
  mem = compiled.memory_analysis()
  return CompileReport(
      target=target,
      temp_bytes=int(getattr(mem, "temp_size_in_bytes", 0)),
      argument_bytes=int(getattr(mem, "argument_size_in_bytes", 0)),
      output_bytes=int(getattr(mem, "output_size_in_bytes", 0)),
      kernel_cycles=_read_cycles(_snapshot(_cycle_dir) - before),
  )


def clear_cycle_dumps() -> None:
  """Removes the dump folder's contents (between CLI runs in one process)."""
  if _cycle_dir and os.path.isdir(_cycle_dir):
    shutil.rmtree(_cycle_dir)
    os.makedirs(_cycle_dir)


# --------------------------------------------------------------------------
# `tokamax-gdn aot`: gated delta rule report (GDN pallas_mosaic_tpu vs KDA).
# --------------------------------------------------------------------------

_GDN_IMPL = "pallas_mosaic_tpu"


def _gdn_fns(hk: int, hv: int):
  """(forward, forward+backward) of GDN through the public API, on prepared args."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import tokamax_gdn  # pylint: disable=g-import-not-at-top

  def fwd(q, k, v, g, beta):
    out, _ = tokamax_gdn.gated_delta_rule(q, k, v, g, beta, implementation=_GDN_IMPL)
    return out

  def fwd_bwd(q, k, v, g, beta):
    def loss(q, k, v, g, beta):
      out, _ = tokamax_gdn.gated_delta_rule(q, k, v, g, beta, implementation=_GDN_IMPL)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

  del hk, hv
  return fwd, fwd_bwd


def _kda_fns(k_dim: int):
  """tokamax KDA (mosaic) with the scalar gate broadcast over K, [H, B, T, D] layout."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tokamax._src.ops.kda import api as kda_api  # pylint: disable=g-import-not-at-top

  def call(q, k, v, g, beta):
    gate = jnp.broadcast_to(g[..., None], g.shape + (k_dim,))
    out, _ = kda_api.kimi_delta_attention(q, k, v, gate, beta, implementation="mosaic")
    return out

  def fwd_bwd(q, k, v, g, beta):
    loss = lambda *a: jnp.sum(call(*a).astype(jnp.float32) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3, 4))(q, k, v, g, beta)

  return call, fwd_bwd


def gdn_report(target: str, *, batch: int, seq_len: int, hk: int, hv: int, k: int,
               v: int, dtype="bfloat16", kda: bool = True,
               gdn: bool = True, passes: Sequence[str] = ("fwd", "fwd+bwd")
               ) -> list[dict[str, Any]]:
  """Compiles GDN (and tokamax KDA) forward and fwd+bwd for `target`.

  One row per (implementation, pass, kernel): compiled or the error, temp /
  argument / output bytes of the whole compiled function, and the kernel's
  static cycle estimate (total and per token). KDA runs with H = hv heads,
  q/k repeated to hv heads (it has no GVA) and the gate broadcast over K.
  """
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  dtype = jnp.dtype(dtype)
  f32 = jnp.float32
  tokens = batch * seq_len
  mesh = target_mesh(target)
  cases = []
  gdn_specs = [spec(mesh, (batch, seq_len, hk, k), dtype), spec(mesh, (batch, seq_len, hk, k), dtype),
               spec(mesh, (batch, seq_len, hv, v), dtype), spec(mesh, (batch, seq_len, hv), f32),
               spec(mesh, (batch, seq_len, hv), dtype)]
  g_fwd, g_fb = _gdn_fns(hk, hv)
  if gdn:
    cases += [("gdn " + _GDN_IMPL, "fwd", g_fwd, gdn_specs),
              ("gdn " + _GDN_IMPL, "fwd+bwd", g_fb, gdn_specs)]
  if kda:
    kda_specs = [spec(mesh, (hv, batch, seq_len, k), dtype), spec(mesh, (hv, batch, seq_len, k), dtype),
                 spec(mesh, (hv, batch, seq_len, v), dtype), spec(mesh, (hv, batch, seq_len), f32),
                 spec(mesh, (hv, batch, seq_len), dtype)]
    k_fwd, k_fb = _kda_fns(k)
    cases += [("tokamax kda mosaic_tpu", "fwd", k_fwd, kda_specs),
              ("tokamax kda mosaic_tpu", "fwd+bwd", k_fb, kda_specs)]
  rows = []
  cases = [c for c in cases if c[1] in passes]
  for impl, pass_, fn, specs_ in cases:
    base_row = dict(target=target, impl=impl, pass_=pass_)
    try:
      rep = compile_for(target, fn, *specs_, mesh=mesh)
    except Exception as e:  # pylint: disable=broad-exception-caught
      rows.append(dict(base_row, kernel="-", compiled=f"FAIL: {str(e).splitlines()[0][:120]}",
                       temp_mib="", arg_mib="", out_mib="", cycles="", cycles_per_token=""))
      continue
    mem = dict(compiled="ok", temp_mib=round(rep.temp_bytes / 2**20, 1),
               arg_mib=round(rep.argument_bytes / 2**20, 1),
               out_mib=round(rep.output_bytes / 2**20, 1))
    kernels = rep.kernel_cycles or {"(no cycle estimates)": None}
    for name, cyc in sorted(kernels.items()):
      rows.append(dict(base_row, kernel=name, **mem,
                       cycles="" if cyc is None else cyc,
                       cycles_per_token="" if not cyc else round(cyc / tokens, 1)))
  return [{("pass" if key == "pass_" else key): val for key, val in r.items()} for r in rows]


def _load_model_yml(path: str) -> dict[str, Any]:
  import yaml  # pylint: disable=g-import-not-at-top
  if not os.path.exists(path):
    alt = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "configs", "models", path if path.endswith(".yml") else path + ".yml")
    path = alt
  with open(path) as f:
    return yaml.safe_load(f)


def main(argv: Sequence[str] | None = None) -> int:
  """`tokamax-gdn aot --target v6e --model configs/models/x.yml --seq-len 4096 [--json]`."""
  import argparse  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  p = argparse.ArgumentParser(prog="tokamax-gdn aot", description=main.__doc__)
  p.add_argument("--target", choices=sorted(config.TPU_GENERATIONS), default="v6e")
  p.add_argument("--model", help="model .yml (hidden_size, num_k_heads, num_v_heads, head_k_dim, head_v_dim)")
  p.add_argument("--seq-len", type=int, default=4096)
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--hk", type=int)
  p.add_argument("--hv", type=int)
  p.add_argument("--k", type=int)
  p.add_argument("--v", type=int)
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--no-kda", action="store_true", help="skip the tokamax KDA comparison")
  p.add_argument("--cycles-seq-len", type=int, default=256,
                 help="sequence length of the separate cycle-estimate compile (the"
                      " estimator's compile time grows with the grid); cycles are"
                      " scaled to --seq-len; 0 skips cycle estimates")
  p.add_argument("--json", action="store_true")
  p.add_argument("--_cycles_only", help=argparse.SUPPRESS)  # "gdn:fwd", "kda:fwd+bwd", ...
  args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
  dims = dict(hk=args.hk, hv=args.hv, k=args.k, v=args.v)
  if args.model:
    m = _load_model_yml(args.model)
    from_model = dict(hk=m["num_k_heads"], hv=m["num_v_heads"], k=m["head_k_dim"],
                      v=m["head_v_dim"])
    dims = {n: dims[n] if dims[n] is not None else from_model[n] for n in dims}
  missing = [n for n, x in dims.items() if x is None]
  if missing:
    p.error(f"give --model or all of --hk --hv --k --v (missing {missing})")
  if args._cycles_only:  # pylint: disable=protected-access
    enable_cycle_estimates()
    which, pass_ = args._cycles_only.split(":")  # pylint: disable=protected-access
    rows = gdn_report(args.target, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                      kda=which == "kda", gdn=which == "gdn", passes=(pass_,), **dims)
    print("GDN_CYCLES_JSON " + json.dumps(rows))
    return 0
  rows = gdn_report(args.target, batch=args.batch, seq_len=args.seq_len, dtype=args.dtype,
                    kda=not args.no_kda, **dims)
  if args.cycles_seq_len:
    cyc_rows = []
    # One subprocess per (implementation, pass): a libtpu abort loses only that one.
    for which in ("gdn",) + (() if args.no_kda else ("kda",)):
      for pass_ in ("fwd", "fwd+bwd"):
        cyc_rows += _cycle_rows(args, dims, f"{which}:{pass_}")
    rows = _merge_cycles(rows, cyc_rows, args.batch * args.seq_len,
                         args.seq_len / args.cycles_seq_len)
  if args.json:
    print(json.dumps(rows, indent=1))
  else:
    cols = list(rows[0])
    cells = [[str(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    for vals in [cols, ["-" * w for w in widths]] + cells:
      print("  ".join(x.ljust(w) for x, w in zip(vals, widths)).rstrip())
  return 0 if all(r["compiled"] == "ok" for r in rows) else 1


def _cycle_rows(args, dims, which: str) -> list[dict[str, Any]]:
  """Cycle estimates from a subprocess at --cycles-seq-len (libtpu reads its
  dump flag once per process, and this process compiled without it)."""
  import json  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top
  cmd = [sys.executable, "-m", "tokamax_gdn.aot", "--_cycles_only", which, "--target", args.target,
         "--seq-len", str(args.cycles_seq_len), "--batch", str(args.batch),
         "--dtype", args.dtype] + [f"--{n}={x}" for n, x in dims.items()]
  env = dict(os.environ, ALLOW_MULTIPLE_LIBTPU_LOAD="1", JAX_PLATFORMS="cpu")
  env.pop("LIBTPU_INIT_ARGS", None)
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
  for line in proc.stdout.splitlines():
    if line.startswith("GDN_CYCLES_JSON "):
      return json.loads(line[len("GDN_CYCLES_JSON "):])
  # libtpu aborts the process on some compiles with the cycle dump on (seen
  # for tokamax KDA's backward): report that instead of failing the table.
  crash = [ln for ln in proc.stderr.splitlines() if "Check failed" in ln][:1]
  print(f"[aot] cycle estimates for {which} unavailable (libtpu exit {proc.returncode}):"
        f" {crash[0][:200] if crash else proc.stderr[-300:]}", file=sys.stderr)
  return []


def _merge_cycles(rows, cyc_rows, tokens: int, scale: float) -> list[dict[str, Any]]:
  """Memory rows at the real length + per-kernel cycles scaled from the short run."""
  def kernel_name(name: str) -> str:
    return re.sub(r"_TPU.*$", "", name)
  out = []
  for r in rows:
    kernels = [c for c in cyc_rows if (c["impl"], c["pass"]) == (r["impl"], r["pass"])
               and c["cycles"] not in ("", None)]
    # Pallas kernels first (name prefixes), XLA glue summed into one row.
    pallas = [c for c in kernels if kernel_name(c["kernel"]).split(".")[0] in (
        "gdn_fwd", "gdn_bwd") or "kda" in c["kernel"].lower() or "chunk" in c["kernel"].lower()]
    glue = sum(int(c["cycles"]) for c in kernels if c not in pallas)
    entries = [(kernel_name(c["kernel"]), int(c["cycles"])) for c in pallas]
    entries.append(("(xla glue, summed)", glue))
    if not kernels:
      out.append(r)
      continue
    for name, cyc in entries:
      total = int(cyc * scale)
      out.append(dict(r, kernel=name, cycles=total, cycles_per_token=round(total / tokens, 1)))
  return out


if __name__ == "__main__":
  import sys  # pylint: disable=g-import-not-at-top
  sys.exit(main())
