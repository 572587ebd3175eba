"""Times each Pallas GDN training kernel alone with its static choices varied.

On a TPU (from the repo root; on the v5e chip host through our runtime,
`bash .tpu/boot.sh run tools/gdn_knob_sweep.py 4096`):

  python tools/gdn_knob_sweep.py [T] [--only SUBSTRING ...] [--interpret]

(`--only`: the variants whose names hold one of the substrings, and the
default of each kernel among them.)

The kernels' static choices (interleave, head groups unrolled, the
backward's head copies, one-product dk, f's row sums as columns, paired T',
chunk 64, the NaN guard, the backward's WY part through V″ or stacked, the
v5e forms (`common.Static.v5e_forms`: forms libtpu's v5e estimator
accepts), and every choice as for v6e) were picked from libtpu's static
estimates; this compiles `gdn_fwd` (with outputs), the VJP's states pass and `gdn_bwd` at the
Qwen3-Next layer's heads (Hk 16, Hv 32, K = V = 128, bf16, the prologue in
the kernels) once per variant, each in a program of its own, and prints ms
per call (the lower of two `timing.wall_ms(n=30)` steady states). A variant patches the
`pallas_mosaic_tpu_common` function that makes the choice while it is
traced. Each figure holds XLA's copies of the [B, T, H, D] arguments into
the kernels' [B, T, H D] layout, the same for every variant of a kernel:
compare within a kernel. `--interpret` runs on CPU (Pallas interpret mode,
slow: use a small T such as 256) to check the script. The last line is the
rows as JSON. docs/performance.md, "chip-gdn-knobs", is one run on v5e.
"""
import concurrent.futures as cf
import contextlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import jax.numpy as jnp

from tokamax_gdn import config as gdn_config
from tokamax_gdn.benchmarks import timing
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_call as call
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_common as common
from tokamax_gdn.ops.gated_delta_rule import pallas_mosaic_tpu_prologue as kp
from tokamax_gdn.ops.gated_delta_rule import prologue
from tokamax_gdn.ops.gated_delta_rule.pallas_mosaic_tpu_vmem import kernel_vmem_limit

args = [a for a in sys.argv[1:] if not a.startswith("--")]
T = int(args[0]) if args else 4096
INTERP = "--interpret" in sys.argv
ONLY = [sys.argv[i + 1] for i, a in enumerate(sys.argv) if a == "--only"]
HK, HV, D = 16, 32, 128
bf = jnp.bfloat16
ks = jax.random.split(jax.random.key(0), 9)
q = jax.random.normal(ks[0], (1, T, HK, D), bf)
k = jax.random.normal(ks[1], (1, T, HK, D), bf)
v = jax.random.normal(ks[2], (1, T, HV, D), bf)
g = jax.random.normal(ks[3], (1, T, HV), bf)
beta = jax.random.normal(ks[4], (1, T, HV), bf)
a_log = jnp.log(jax.random.uniform(ks[5], (HV,), jnp.float32, 1.0, 16.0))
dt_bias = jax.random.normal(ks[6], (HV,), jnp.float32) * 0.5
d_out = jax.random.normal(ks[7], (1, T, HV, D), bf)
SCALE = D ** -0.5
LIMIT = None if INTERP else kernel_vmem_limit(gdn_config.target_generation())

# Variant keyword -> the `pallas_mosaic_tpu_common` function that makes that choice.
KNOBS = dict(unroll="unroll_groups", paired="paired_tmats", dksym="dk_symmetric",
             copies="bwd_head_copies", fcols="f_sums_as_columns", v5e_forms="v5e_forms",
             vnew="bwd_through_vnew")
# Every choice as for v6e (bf16 forms, f's sums as columns, the backward's
# head copies, two-product dk, T' unpaired, its WY part stacked), on this chip.
AS_V6E = dict(v5e_forms=False, fcols=True, copies=True, dksym=False, paired=False, vnew=False)
ORIG = {n: getattr(common, n) for n in KNOBS.values()}


@contextlib.contextmanager
def patched(**kn):
  """The choices in `kn` fixed while the kernels are traced (each function
  returns its value whatever it is asked)."""
  try:
    for knob, value in kn.items():
      setattr(common, KNOBS[knob], lambda *_, x=value, **__: x)
    yield
  finally:
    for n, f in ORIG.items():
      setattr(common, n, f)


def pro(a_log, dt_bias):
  return kp.Prologue(qk_l2norm=True, a_log=a_log, dt_bias=dt_bias,
                     log_decay_floor=prologue.CHUNKED_LOG_DECAY_FLOOR, beta_sigmoid=True)


def fwd_fn(chunk, ilv, guard, write_out):
  def f(q, k, v, g, beta, a_log, dt_bias):
    out, _, res = call.gdn_fwd(q, k, v, g, beta, scale=SCALE, chunk=chunk, interleave=ilv,
                               write_out=write_out, emit_residuals=not write_out,
                               final_state=False, interpret=INTERP, vmem_limit_bytes=LIMIT,
                               guard=guard, pro=pro(a_log, dt_bias))
    return out if write_out else res
  return f


def bwd_fn(chunk, ilv, guard):
  def f(q, k, v, g, beta, a_log, dt_bias, d_out, res):
    return call.gdn_bwd(q, k, v, g, beta, d_out, None, scale=SCALE, chunk=chunk, interleave=ilv,
                        residuals=res, interpret=INTERP, vmem_limit_bytes=LIMIT, guard=guard,
                        pro=pro(a_log, dt_bias))
  return f


X = (q, k, v, g, beta, a_log, dt_bias)
# name, kind, chunk, interleave, guard, patches
V = [
    ("fwd", "fwd", 128, 16, True, {}),
    ("fwd noguard", "fwd", 128, 16, False, {}),
    ("fwd ilv8", "fwd", 128, 8, True, {}),
    ("fwd ilv32", "fwd", 128, 32, True, {}),
    ("fwd unroll2", "fwd", 128, 16, True, dict(unroll=2)),
    ("fwd nounroll", "fwd", 128, 16, True, dict(unroll=False)),
    ("fwd c64", "fwd", 64, 16, True, {}),
    ("fwd c64 ilv32", "fwd", 64, 32, True, {}),
    ("fwd bf16 forms", "fwd", 128, 16, True, dict(v5e_forms=False)),
    ("states", "states", 128, 32, True, {}),
    ("states noguard", "states", 128, 32, False, {}),
    ("states ilv16", "states", 128, 16, True, {}),
    ("states ilv8", "states", 128, 8, True, {}),
    ("states unroll2", "states", 128, 32, True, dict(unroll=2)),
    ("states unpaired", "states", 128, 32, True, dict(paired=False)),
    ("states c64", "states", 64, 32, True, {}),
    ("states bf16 forms", "states", 128, 32, True, dict(v5e_forms=False)),
    ("states as v6e", "states", 128, 32, True, AS_V6E),
    ("bwd", "bwd", 128, 8, True, {}),
    ("bwd noguard", "bwd", 128, 8, False, {}),
    ("bwd ilv4", "bwd", 128, 4, True, {}),
    ("bwd ilv16", "bwd", 128, 16, True, {}),
    ("bwd ilv2", "bwd", 128, 2, True, {}),
    ("bwd unroll2", "bwd", 128, 8, True, dict(unroll=2)),
    ("bwd nounroll", "bwd", 128, 8, True, dict(unroll=False)),
    ("bwd copies", "bwd", 128, 8, True, dict(copies=True)),
    ("bwd nodksym", "bwd", 128, 8, True, dict(dksym=False)),
    ("bwd fcols", "bwd", 128, 8, True, dict(fcols=True)),
    ("bwd unpaired", "bwd", 128, 8, True, dict(paired=False)),
    ("bwd stacked WY", "bwd", 128, 8, True, dict(vnew=False)),
    ("bwd c64", "bwd", 64, 8, True, {}),
    ("bwd c64 ilv16", "bwd", 64, 16, True, {}),
    ("bwd bf16 forms", "bwd", 128, 8, True, dict(v5e_forms=False)),
    ("bwd as v6e", "bwd", 128, 8, True, AS_V6E),
]
if ONLY:   # the chosen variants, and the default of each kernel they vary (rel's base)
  chosen = [x for x in V if any(o in x[0] for o in ONLY)]
  V = [x for x in V if x in chosen or (x[0] == x[1] and any(c[1] == x[1] for c in chosen))]

t0 = time.time()
# Residuals per (chunk, guard, paired): computed eagerly with the base states pass.
RES = {}


def residuals(chunk, guard, paired):
  key = (chunk, guard, paired)
  if key not in RES:
    with patched(paired=paired):
      RES[key] = jax.jit(fwd_fn(chunk, 32, guard, False))(*X)
  return RES[key]


lowered = []
for name, kind, chunk, ilv, guard, kn in V:
  try:
    with patched(**kn):
      if kind == "bwd":
        res = residuals(chunk, guard, kn.get("paired", common.paired_tmats()))
        a = X + (d_out, res)
        lo = jax.jit(bwd_fn(chunk, ilv, guard)).lower(*a)
      else:
        a = X
        lo = jax.jit(fwd_fn(chunk, ilv, guard, kind == "fwd")).lower(*a)
    lowered.append((name, lo, a))
  except Exception as e:  # pylint: disable=broad-except
    print(f"{name}: lower failed {type(e).__name__}: {str(e)[:300]}", flush=True)
print(f"lowered {len(lowered)} in {time.time() - t0:.1f} s", flush=True)


def comp(item):
  name, lo, a = item
  s = time.time()
  try:
    return name, lo.compile(), a, time.time() - s, None
  except Exception as e:  # pylint: disable=broad-except
    return name, None, a, time.time() - s, f"{type(e).__name__}: {str(e)[:300]}"


with cf.ThreadPoolExecutor(8) as ex:
  compiled = list(ex.map(comp, lowered))
print(f"compiled in {time.time() - t0:.1f} s", flush=True)
rows = []
for name, c, a, secs, err in compiled:
  if err:
    print(f"{name}: {err}", flush=True)
    rows.append(dict(name=name, error=err))
    continue
  ms = min(timing.wall_ms(c, *a, n=30 if not INTERP else 2) for _ in range(2))
  rows.append(dict(name=name, ms=ms, compile_s=secs))
  print(f"{name:24s} {ms:8.4f} ms  (compile {secs:.1f} s)", flush=True)
print(json.dumps(rows))
print(f"done {time.time() - t0:.1f} s")
