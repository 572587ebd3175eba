"""Lowering and compile seconds, per program, of what users compile first.

On the TPU chip host (from the repo root, through our runtime):

  bash .tpu/boot.sh run tools/compile_times.py --time --variants main,default

On a CPU the same programs are compiled ahead of time for `--target` (v5e by
default) through libtpu, which runs Mosaic's real passes (no `--time`).

  python tools/compile_times.py [--sections gdn,kernels,validate,train]
      [--variants NAME,...] [--target v5e] [--train-dtype bfloat16] [--time] [--json]

Sections (each program lowered, then compiled, one at a time):
- gdn: the GDN layer's call (`workload.layer_fns`) at the Qwen3-Next shape
  (B 1, T 4096, Hk 16, Hv 32, K = V = 128, bf16, the [B, T, H D] layout a
  model feeds), Pallas: its forward, then its forward + backward ("step"),
  in that order in one process, as a user compiles them. With `--time` (on a
  TPU) each is also timed (`timing.wall_ms`, steady state).
- kernels: each Pallas GDN kernel of the step alone at that shape (the
  forward, the VJP's states pass, the backward), with the interleaves the op
  picks there on v5e: where Mosaic's time goes.
- validate: every program `tokamax-gdn validate --model qwen3.5-tiny`
  compiles (`validate.programs`, T = 64, float32), one after another; the
  command compiles them in parallel, so its compile phase takes about the
  longest of them (time the command itself for the end-to-end figure).
- train: the qwen3.5-tiny AdamW training step at B 1, T 4096, as
  `tokamax-gdn train --compare-impls pallas_mosaic_tpu` builds it
  (`training.step.make_train_step`), activations in `--train-dtype`.

Variants (`--variants`, each runs every section, in the order given; the
static choices are patched while the programs are traced, as
`tools/gdn_knob_sweep.py` does):
- default: the code as it is.
- main: the Pallas GDN kernels' calls as before the compile-time work:
  equal kernel calls traced again (`pallas_mosaic_tpu_call.cache_calls(False)`)
  and small grids unrolled like long ones (`common.small_grid` never true).
  (gmm's and tgmm's jitted kernels and the MoE's gather VJPs stay.)
- uncached: only the former; unrolled-small: only the latter.
- bwd-unroll2, rolled: the backward's head groups unrolled by 2 (two basic
  blocks of 16 heads a grid step) / every kernel's head groups in a loop, at
  every length (faster compiles, slower kernels: time them with `--time`).
A process keeps JAX's own caches across variants (gmm's and tgmm's jitted
kernels among them, which "main" does not undo): compare a variant with
the one run before it in the same order, or run each in its own process.

`validate`'s whole command, from its start (its target), is timed apart:
`time python -m tokamax_gdn.cli validate --model qwen3.5-tiny`.

Columns: lower s and compile s, wall clock, each with this process's CPU
seconds over it in parentheses (a compile's threads add up; on a shared CPU
the CPU seconds are the steadier figure), kernels (Pallas calls in the
compiled program), ms (with `--time`). The last line is the rows as JSON.
"""

import argparse
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

from tokamax_gdn import aot  # pylint: disable=g-import-not-at-top
from tokamax_gdn import config as gdn_config  # pylint: disable=g-import-not-at-top
from tokamax_gdn.benchmarks import timing  # pylint: disable=g-import-not-at-top
from tokamax_gdn.benchmarks import workload  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_call as call  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kernel_prologue  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.gated_delta_rule import prologue  # pylint: disable=g-import-not-at-top
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_vmem import kernel_vmem_limit  # pylint: disable=g-import-not-at-top

IMPL = "pallas_mosaic_tpu"
MODEL = "qwen3.5-tiny"
QWEN3_NEXT = workload.LayerShape(b=1, t=4096, hk=16, hv=32, k=128, v=128, flat=True)
TRAIN_BATCH, TRAIN_LEN = 1, 4096
# The op's interleaves at the Qwen3-Next shape on v5e (forward, states pass,
# backward): `pallas_mosaic_tpu._heuristics`, `_states_config`.
KERNEL_INTERLEAVES = dict(fwd=16, states=32, bwd=8)
SECTIONS = ("gdn", "kernels", "validate", "train")

_ORIGINAL = {n: getattr(common, n) for n in ("small_grid", "unroll_groups")}


def _never_small(steps):
  del steps
  return False


def _unroll(fwd, bwd):
  def unroll_groups(backward=False, steps=None):
    if common.small_grid(steps):
      return False
    return bwd if backward else fwd
  return unroll_groups


# Variant name -> (kernel calls shared, {common function: replacement}).
VARIANTS = {
    "default": (True, {}),
    "main": (False, dict(small_grid=_never_small)),
    "uncached": (False, {}),
    "unrolled-small": (True, dict(small_grid=_never_small)),
    "bwd-unroll2": (True, dict(unroll_groups=_unroll(True, 2))),
    "rolled": (True, dict(unroll_groups=_unroll(False, False))),
}


@contextlib.contextmanager
def variant(name: str):
  """The variant's choices in force (module docstring)."""
  cached, patches = VARIANTS[name]
  call.cache_calls(cached)
  try:
    for fn_name, fn in patches.items():
      setattr(common, fn_name, fn)
    yield
  finally:
    for fn_name, fn in _ORIGINAL.items():
      setattr(common, fn_name, fn)
    call.cache_calls(True)


class Target:
  """Where programs compile: the TPU this process has, or ahead of time for a
  generation (`aot.on_target`); `spec` places an abstract argument there."""

  def __init__(self, generation: str):
    self.on_chip = jax.default_backend() == "tpu"
    self.mesh = None if self.on_chip else aot.target_mesh(generation)
    self.name = jax.devices()[0].device_kind if self.on_chip else f"{generation} (ahead of time)"

  def spec(self, shape, dtype) -> jax.ShapeDtypeStruct:
    if self.on_chip:
      return jax.ShapeDtypeStruct(tuple(shape), dtype)
    return aot.spec(self.mesh, shape, dtype)

  def place(self, tree):
    """ShapeDtypeStructs (or arrays) of `tree` as this target's abstract arguments."""
    return jax.tree.map(lambda x: self.spec(x.shape, x.dtype), tree)

  def context(self):
    return contextlib.nullcontext() if self.on_chip else aot.on_target(self.mesh)


def measure(label: str, lower, *, time_with=None) -> dict:
  """Lowers (`lower()` -> a `Lowered`) and compiles one program; with
  `time_with` (arguments), times the compiled program too."""
  row = dict(program=label)
  try:
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = lower()
    c1, t1 = time.process_time(), time.perf_counter()
    compiled = lowered.compile()
    c2, t2 = time.process_time(), time.perf_counter()
    row.update(lower_s=t1 - t0, compile_s=t2 - t1, lower_cpu_s=c1 - c0, compile_cpu_s=c2 - c1,
               kernels=sum(aot.pallas_calls(compiled.as_text()).values()))
    if time_with is not None:
      row["ms"] = timing.wall_ms(compiled, *time_with)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
  return row


def _random(tree, seed: int = 0):
  """Random arrays shaped as `tree`'s leaves, drawn in numpy (a jax.random
  draw is a compile of its own)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
      lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32) * 0.5, s.dtype), tree)


def gdn_section(target: Target, timed: bool) -> list[dict]:
  s = QWEN3_NEXT
  fwd, step = workload.layer_fns(s, IMPL)
  args = target.place(workload.abstract_inputs(s))
  xs = _random(workload.abstract_inputs(s)) if timed else None
  rows = []
  for name, fn in (("gdn fwd", fwd), ("gdn step", step)):
    def lower(fn=fn):
      with target.context():
        return jax.jit(fn).lower(*args)
    rows.append(measure(name, lower, time_with=xs))
  return rows


def _kernel_fn(kind: str):
  """One Pallas GDN kernel alone, as the op calls it at `QWEN3_NEXT` (the
  prologue and the NaN guard in the kernels)."""
  s = QWEN3_NEXT
  split = lambda x, d: x.reshape(*x.shape[:2], -1, d)
  kwargs = dict(scale=s.k ** -0.5, chunk=128, interleave=KERNEL_INTERLEAVES[kind], guard=True,
                vmem_limit_bytes=kernel_vmem_limit(gdn_config.target_generation()))

  def pro(a_log, dt_bias):
    return kernel_prologue.Prologue(qk_l2norm=True, a_log=a_log, dt_bias=dt_bias,
                                    log_decay_floor=prologue.CHUNKED_LOG_DECAY_FLOOR,
                                    beta_sigmoid=True)

  def forward(q, k, v, g, beta, a_log, dt_bias):
    out, _, res = call.gdn_fwd(split(q, s.k), split(k, s.k), split(v, s.v), g, beta,
                               write_out=kind == "fwd", emit_residuals=kind != "fwd",
                               final_state=False, pro=pro(a_log, dt_bias), **kwargs)
    return out if kind == "fwd" else res

  def backward(q, k, v, g, beta, a_log, dt_bias, d_out, states, tmats, flags):
    return call.gdn_bwd(split(q, s.k), split(k, s.k), split(v, s.v), g, beta, split(d_out, s.v),
                        None, residuals=(states, tmats, flags), pro=pro(a_log, dt_bias),
                        **kwargs)

  return backward if kind == "bwd" else forward


def kernels_section(target: Target) -> list[dict]:
  s = QWEN3_NEXT
  inputs = workload.abstract_inputs(s)
  nc = s.t // 128
  sds = jax.ShapeDtypeStruct
  residuals = (sds((s.b, nc, s.hv, s.k, s.v), s.dtype), sds((s.b, nc, s.hv, 128, 128), s.dtype),
               sds((s.b, nc, s.hv, 128), jnp.float32))
  rows = []
  for kind, name in (("fwd", "gdn_fwd"), ("states", "gdn_fwd_states"), ("bwd", "gdn_bwd")):
    args = target.place(inputs + ((inputs[2],) + residuals if kind == "bwd" else ()))

    def lower(kind=kind, args=args):
      with target.context():
        return jax.jit(_kernel_fn(kind)).lower(*args)
    rows.append(measure(f"kernel {name}", lower))
  return rows


def validate_section(target: Target) -> list[dict]:
  from tokamax_gdn import validate  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.layers import load_preset  # pylint: disable=g-import-not-at-top
  cfg = load_preset(MODEL)
  rows = []
  with target.context():   # (off TPU: so that the Pallas rows count as runnable)
    programs = validate.programs(cfg, seq_len=64, batch=1)
  for program in programs:
    args = target.place(program.abstract)

    def lower(program=program, args=args):
      with target.context():
        return program.lower(args)
    rows.append(measure(f"validate {program.label}", lower))
  return rows


def train_section(target: Target, dtype) -> list[dict]:
  from tokamax_gdn.models import decoder  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.models.config import ModelConfig  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.training import step as step_lib  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.training.data import RecallTask  # pylint: disable=g-import-not-at-top
  task = RecallTask.for_seq_len(TRAIN_LEN)
  cfg = ModelConfig.load(MODEL, vocab_size=task.vocab_size)
  optimizer = step_lib.make_optimizer(1e-3, 100)
  params = jax.eval_shape(lambda: decoder.init_params(jax.random.key(0), cfg))
  opt_state = jax.eval_shape(optimizer.init, params)
  batch = jax.eval_shape(lambda: task.batch(jax.random.key(1), TRAIN_BATCH))
  step = step_lib.make_train_step(cfg, optimizer, step_lib.StepConfig(implementation=IMPL,
                                                                      dtype=dtype))
  args = target.place((params, opt_state, batch))

  def lower():
    with target.context():
      return step.lower(*args)
  label = f"train {MODEL} B{TRAIN_BATCH} T{TRAIN_LEN} {jnp.dtype(dtype).name}"
  return [measure(label, lower)]


def _fmt(x, digits=2):
  return "" if x is None else (f"{x:.{digits}f}" if isinstance(x, float) else str(x))


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--sections", default=",".join(SECTIONS))
  p.add_argument("--variants", default="default", help=f"among {', '.join(VARIANTS)}")
  p.add_argument("--target", default="v5e", help="off TPU: the generation compiled for")
  p.add_argument("--train-dtype", default="bfloat16", choices=("bfloat16", "float32"))
  p.add_argument("--time", action="store_true", help="on a TPU: also time the gdn programs")
  p.add_argument("--json", action="store_true", help="only the JSON rows")
  p.add_argument("--record", metavar="NAME",
                 help="also write the rows as section NAME of docs/performance.md")
  args = p.parse_args(argv)
  sections = [x for x in args.sections.split(",") if x]
  variants = [x for x in args.variants.split(",") if x]
  for name, valid in ((sections, SECTIONS), (variants, VARIANTS)):
    bad = [x for x in name if x not in valid]
    if bad:
      p.error(f"unknown {bad}; valid: {', '.join(valid)}")
  start = time.perf_counter()
  target = Target(args.target)
  if args.time and not target.on_chip:
    p.error("--time needs a TPU")
  log = (lambda msg: None) if args.json else (lambda msg: print(msg, flush=True))
  log(f"compiling for {target.name}; jax {jax.__version__}; the backend took"
      f" {time.perf_counter() - start:.1f} s to start")
  rows = []
  for var in variants:
    for section in sections:
      start = time.perf_counter()
      with variant(var):
        if section == "gdn":
          got = gdn_section(target, args.time)
        elif section == "kernels":
          got = kernels_section(target)
        elif section == "validate":
          got = validate_section(target)
        else:
          got = train_section(target, jnp.dtype(args.train_dtype))
      for row in got:
        row.update(variant=var, section=section)
        log(f"{var:14s} {row['program']:56s} lower {_fmt(row.get('lower_s')):>6s} s"
            f" ({_fmt(row.get('lower_cpu_s')):>6s})  compile {_fmt(row.get('compile_s')):>6s} s"
            f" ({_fmt(row.get('compile_cpu_s')):>6s})  kernels {_fmt(row.get('kernels')):>2s}"
            + (f"  {row['ms']:.4f} ms" if "ms" in row else "")
            + (f"  {row['error']}" if "error" in row else ""))
      done = [r for r in got if "error" not in r]
      total = lambda k: sum(r[k] for r in done)
      log(f"{var:14s} {section}: {len(got)} programs, lower {total('lower_s'):.1f} s"
          f" ({total('lower_cpu_s'):.1f}), compile {total('compile_s'):.1f} s"
          f" ({total('compile_cpu_s'):.1f}), longest"
          f" {max((r['lower_s'] + r['compile_s'] for r in done), default=0):.1f} s,"
          f" section {time.perf_counter() - start:.1f} s")
      rows += got
  if args.record:
    _record(args.record, rows, target, argv if argv is not None else sys.argv[1:])
  print(json.dumps(rows))
  return 1 if any("error" in r for r in rows) else 0


def _record(name: str, rows: list[dict], target: Target, argv: list[str]) -> None:
  from tokamax_gdn.benchmarks import record  # pylint: disable=g-import-not-at-top
  columns = dict(variant="variant", program="program", lower_s="lower s",
                 lower_cpu_s="lower CPU s", compile_s="compile s", compile_cpu_s="compile CPU s",
                 kernels="kernels", ms="ms", error="error")
  columns = {k: v for k, v in columns.items() if any(k in r for r in rows)}
  cells = [{k: (round(v, 2 if k != "ms" else 4) if isinstance(v, float) else v)
            for k, v in r.items()} for r in rows]
  title = ("Compile time per program: the GDN layer's forward and step at the Qwen3-Next"
           " shape (Pallas), each Pallas GDN kernel alone, validate's programs"
           f" ({MODEL}), the {MODEL} training step, on {target.name} (wall clock, and this"
           " process's CPU seconds, which add up the compile's threads)")
  record.write_section(None, name, title,
                       "python tools/compile_times.py " + " ".join(argv), cells, columns,
                       device=target.name)


if __name__ == "__main__":
  sys.exit(main())
