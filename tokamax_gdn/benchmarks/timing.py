"""Wall-clock timing on the device, the chip's floors, and per-op device time.

What every on-chip table of `tokamax-gdn bench` is built from:

- `wall_ms`: a compiled function's time per call in steady state (the slope
  between two bursts of calls dispatched back to back), or per synchronous
  call.
- `measure_floors`: the rates this chip reaches in the same run: a bf16
  matmul's FLOP/s and an HBM stream's bytes/s (read + write), next to the
  published peaks of its generation (`PEAKS`). A row's floor is its essential
  FLOPs or its minimal HBM bytes at those rates, whichever takes longer.
- `device_events`: a `jax.profiler` trace of a few calls, the device's op
  events; `op_table`: where one call's device time goes, per kernel and per
  XLA op; `busy_ms`: the device's busy time from the same events, nested
  ones once.
"""

import collections
import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp

from tokamax_gdn.training import profile

# Published peaks: bf16 dense MXU FLOP/s and HBM bytes/s per chip.
PEAKS: dict[str, tuple[float, float]] = {
    "v5e": (197e12, 819e9),
    "v6e": (918e12, 1640e9),
    "v5p": (459e12, 2765e9),
    "tpu7x": (2307e12, 7380e9),
}


def wall_ms(fn: Callable[..., Any], *args, n: int = 20, warm: int = 2, sync: bool = False
            ) -> float:
  """Wall time of one call of `fn(*args)` in ms, after `warm` untimed calls.

  By default the steady state, as a training loop or a serving engine sees
  it (the host dispatching ahead of the chip): two bursts of calls
  dispatched back to back, `n` and then `2 n` (`timed_calls(n)` in all),
  each waited for once, and the per-call slope between them, (t(2 n) -
  t(n)) / n. A burst's time also holds the latency before its first call
  starts and after its last ends (about a host round trip, `round_trip_ms`,
  0.54 ms on the v5e chip host); one burst's mean would charge 1/n of it to
  every call (+39 µs per call at n = 20 for the GDN step at T = 4096,
  where 100 calls left +10 µs), the slope none. For a cost that grows with
  the call's index i (a decode step's KV length) the slope is the cost at
  index `steady_index(n)`. (Where noise puts the slope outside (0, the
  longer burst's mean], that mean.)

  With `sync`, the median of `n` calls each waited for: that adds the
  host's round trip to every call.
  """
  for _ in range(warm):
    jax.block_until_ready(fn(*args))
  if not sync:
    def burst(calls):
      start = time.perf_counter()
      for _ in range(calls):
        out = fn(*args)   # one device stream: the last result is ready after all
      jax.block_until_ready(out)
      return time.perf_counter() - start
    first, second = burst(n), burst(2 * n)
    slope, mean = (second - first) / n, second / (2 * n)
    # The longer burst's mean bounds the steady state from above; where
    # noise outweighs the calls (a few calls of a few µs) the slope can fall
    # outside (0, mean], and the mean is the better figure.
    return (slope if 0 < slope <= mean else mean) * 1e3
  times = []
  for _ in range(n):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times) * 1e3


def timed_calls(n: int, sync: bool = False) -> int:
  """The calls `wall_ms(n=n, sync=sync)` times (its `warm` ones not counted)."""
  return n if sync else 3 * n


def steady_index(n: int) -> float:
  """The call index (0 = the first timed call) whose cost `wall_ms(n=n)`'s
  steady state measures when a call's cost is linear in its index: the
  bursts cover calls [0, n) and [n, 3 n), and (t(2 n) - t(n)) / n is
  a + b (3.5 n - 0.5) for a cost a + b i."""
  return 3.5 * n - 0.5


def round_trip_ms(n: int = 50) -> float:
  """A synchronous call of a trivial jitted function: the host's dispatch and
  wait, what `wall_ms(sync=True)` adds to every call."""
  tiny = jax.jit(lambda x: x + 1)
  return wall_ms(tiny, jnp.ones((8, 128), jnp.float32), n=n, sync=True)


@dataclasses.dataclass(frozen=True)
class Floors:
  """Rates measured on this chip in this run, and its generation's peaks."""

  device_kind: str
  generation: str | None
  mxu_flops: float           # bf16 matmul FLOP/s measured
  hbm_bytes: float           # HBM read + write bytes/s measured
  peak_flops: float | None   # published
  peak_hbm: float | None

  def floor_ms(self, flops: float = 0.0, hbm_bytes: float = 0.0, *, peak: bool = False
               ) -> float:
    """The longer of the FLOPs' and the bytes' time at the measured rates (or
    the published peaks), in ms."""
    f, b = ((self.peak_flops, self.peak_hbm) if peak and self.peak_flops
            else (self.mxu_flops, self.hbm_bytes))
    return max(flops / f, hbm_bytes / b) * 1e3

  def bound(self, flops: float = 0.0, hbm_bytes: float = 0.0, *, peak: bool = False) -> str:
    """Which of the two sets `floor_ms`: "MXU" (the FLOPs) or "HBM" (the bytes)."""
    f, b = ((self.peak_flops, self.peak_hbm) if peak and self.peak_flops
            else (self.mxu_flops, self.hbm_bytes))
    return "MXU" if flops / f > hbm_bytes / b else "HBM"

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def measure_floors(matmul_n: int = 8192, stream_bytes: int = 1 << 31, n: int = 10) -> Floors:
  """A bf16 `matmul_n`³ matmul's FLOP/s and a `stream_bytes` f32 array read
  and written once (an elementwise scale), on the default device."""
  from tokamax_gdn import config  # pylint: disable=g-import-not-at-top
  key = jax.random.key(0)
  a = jax.random.normal(key, (matmul_n, matmul_n), jnp.bfloat16)
  mm = jax.jit(lambda x, y: x @ y)
  mm_ms = wall_ms(mm, a, a, n=n)
  x = jnp.ones((stream_bytes // 4,), jnp.float32)
  scale = jax.jit(lambda x: x * 1.0001)
  st_ms = wall_ms(scale, x, n=n)
  del a, x
  kind = jax.devices()[0].device_kind
  gen = config.generation_from_device_kind(kind)
  peak = PEAKS.get(gen.name) if gen is not None else None
  return Floors(device_kind=kind, generation=gen.name if gen else None,
                mxu_flops=2 * matmul_n**3 / (mm_ms / 1e3),
                hbm_bytes=2 * stream_bytes / (st_ms / 1e3),
                peak_flops=peak[0] if peak else None, peak_hbm=peak[1] if peak else None)


def device_events(fn: Callable[..., Any], *args, calls: int = 3,
                  device_substring: str = "TPU") -> list[tuple[str, str, float, float]]:
  """The device's duration events of `calls` traced calls of `fn(*args)`
  (after one untimed call): [(track, name, start us, duration us)].

  Reads the perfetto trace `jax.profiler` writes: the "X" events of the
  processes whose names contain `device_substring`. A kernel shows under its
  `pallas_call` name (e.g. `gdn_fwd`), an XLA op under its fusion's name; a
  loop's op event encloses its body's events on the same track.
  """
  jax.block_until_ready(fn(*args))
  events = profile.trace_calls(lambda: fn(*args), calls)
  process, thread = {}, {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") == "process_name":
      process[e["pid"]] = e["args"]["name"]
    elif e.get("ph") == "M" and e.get("name") == "thread_name":
      thread[(e["pid"], e["tid"])] = e["args"]["name"]
  return [(thread.get((e["pid"], e["tid"]), str(e["tid"])), e["name"],
           float(e.get("ts", 0.0)), float(e.get("dur", 0.0)))
          for e in events
          if e.get("ph") == "X" and device_substring in process.get(e["pid"], "")]


def op_table(events, calls: int) -> list[dict[str, Any]]:
  """[{name, thread, us, count}] per (track, name), per call, the largest first.
  Nested events each count in their own row (a loop and its body's ops). The
  "Steps" track is left out: its events ("0", "1", ...) are the profiler's
  step markers, spans of the trace rather than device work, and read as ops
  they outranked the kernels."""
  total = collections.defaultdict(float)
  count = collections.Counter()
  for track, name, _, dur in events:
    if track.endswith("Steps"):
      continue
    total[(track, name)] += dur / calls
    count[(track, name)] += 1
  rows = [dict(thread=k[0], name=k[1], us=us, count=count[k] // calls)
          for k, us in total.items()]
  return sorted(rows, key=lambda r: -r["us"])


def busy_ms(events, calls: int, track: Callable[[str], bool]) -> float:
  """Per call, the time the tracks that `track` accepts are busy: the union of
  their events' intervals per track, summed over tracks, so that an op
  enclosing others (a while loop and its body) counts once."""
  by_track = collections.defaultdict(list)
  for t, _, ts, dur in events:
    if track(t):
      by_track[t].append((ts, ts + dur))
  total = 0.0
  for spans in by_track.values():
    spans.sort()
    end = -float("inf")
    for a, b in spans:
      if a >= end:
        total += b - a
        end = b
      elif b > end:
        total += b - end
        end = b
  return total / calls / 1e3
