"""`models.generate` on the chip: prefill and decode steps of a model preset,
their tokens/s, the decode step against its HBM floor, and the GDN op's share
of each step's device time (`tokamax-gdn bench --op generate`).

`generate` is one prefill `step` (every prompt's tokens in one ragged call)
and then one decode `step` per new token (one token per request). Each row
times one of those calls as `generate` issues it: `generation.step_program`
compiled once for the row's shapes, the cache donated and fed back, calls
dispatched back to back (`timing.wall_ms`), so the figure is the step's
steady state, not the host's round trip.

- prefill: B fresh prompts of `prompt_len` tokens each (the cache's lengths
  are reset to 0 before each call, so every call is a fresh prefill).
- decode: one token for each of B requests that have seen `prompt_len`
  tokens; consecutive calls continue (position prompt_len, prompt_len + 1,
  ...) exactly as `generate`'s decode loop does. The cache holds enough
  positions for every call the row makes. The decode starts from a cache
  whose lengths say prompt_len tokens were seen (zero states and keys): the
  step's work does not depend on the values, and a decode row so does not
  depend on the prefill row having run.

The HBM floor of a decode step (`decode_hbm_bytes`) is the least a step must
move: every weight it uses read once, every GDN layer's recurrent and conv
state read and written for each request, and the attention layers' KV cache
read up to each request's length (the new token's keys and values written).
Two refinements of "every weight": the embedding table is gathered by rows
(B rows, unless tied to the LM head, which reads it whole), and a MoE layer's
B · top_k assignments reach at most min(E, B · top_k) experts (exactly top_k
at batch 1, where counting all E would put the floor above what the step
needs). Activations (a few rows per layer) and the logits are left out.

The GDN share comes from a profile of the step on a TPU, split as a training
step's is (`training.step_split`): the device's op events, each attributed
through the compiled module's text to the tokamax Op that emitted it or, for
a Pallas kernel, by its name. GDN is the serving op
`causal_conv1d_gated_delta_rule` (conv and recurrence, every
implementation); the layers' projections around it are "the rest".
Off a TPU the profile has no device track: device time and share are None.
"""

from collections.abc import Callable, Sequence
import math
import time
from typing import Any

import jax
import jax.numpy as jnp

from tokamax_gdn import registry
from tokamax_gdn.benchmarks import timing
from tokamax_gdn.models import decoder
from tokamax_gdn.models import generation
from tokamax_gdn.models.config import ModelConfig
from tokamax_gdn.training import profile
from tokamax_gdn.training import step_split

PALLAS = "pallas_mosaic_tpu"
WARM = 2             # untimed calls before the timed ones (`timing.wall_ms`'s warm-up)
PROFILE_CALLS = 3    # profiled calls, after one untimed call


def _quiet(line: str) -> None:
  del line


def _error(e: BaseException) -> str:
  return f"{type(e).__name__}: {e}".replace("\n", " ")[:300]


def _done(row: dict[str, Any]) -> str:
  what = f"generation {row['impl']} B={row['batch']} {row['phase']}"
  if row.get("ms") is None:
    return f"{what}: {row.get('error')}"
  line = f"{what}: {row['ms']:.3f} ms, {row['tokens_per_s']:.1f} tokens/s"
  # The whole row on its line: a run stopped at a time limit keeps what it measured.
  if row.get("over_floor") is not None:
    line += f", {row['over_floor']:.2f}x its HBM floor ({row['floor_ms']:.3f} ms)"
  if row.get("device_ms") is not None:
    line += f", device {row['device_ms']:.3f} ms"
    if row.get("gdn_share") is not None:
      line += f" (GDN {100 * row['gdn_share']:.0f} %)"
  return line + f", compiled in {row['compile_s']:.1f} s"


# ---------------------------------------------------------------------------
# The floor


def _nbytes(tree) -> int:
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def decode_hbm_bytes(cfg: ModelConfig, params, batch: int, kv_positions: float,
                     cache: generation.GenerationCache) -> dict[str, float]:
  """The minimal HBM bytes of one decode step of `batch` requests (module
  docstring), by part: weights, GDN states, KV cache, and their total.

  kv_positions: the positions each request's attention reads, its new token's
  included (its keys and values written, the others read). The state and KV
  bytes use `cache`'s dtypes, the weights `params`' own.
  """
  weights = _nbytes(params)
  embed = params["embed"]
  if not cfg.tie_word_embeddings:      # the LM head is its own matrix: B rows gathered
    weights -= _nbytes(embed) - batch * embed.shape[1] * jnp.dtype(embed.dtype).itemsize
  experts = sum(_nbytes({k: kind["moe"][k] for k in ("gate_proj", "up_proj", "down_proj")})
                for kind in params["blocks"].values())
  used = min(cfg.num_experts, batch * cfg.num_experts_per_tok) / cfg.num_experts
  weights -= experts * (1.0 - used)
  # Each request's slot of every GDN pool, read and written once.
  states = 2 * batch * sum(_nbytes(pool) / pool.shape[0] for pair in cache.gdn for pool in pair)
  kv = 0.0
  for keys, values in cache.kv:        # [slots, max_len, kv_heads, head_dim]
    for a in (keys, values):
      kv += batch * kv_positions * math.prod(a.shape[2:]) * jnp.dtype(a.dtype).itemsize
  return dict(weights=float(weights), states=float(states), kv=float(kv),
              total=float(weights + states + kv))


# ---------------------------------------------------------------------------
# The GDN share of a step's device time


def _profile_split(call: Callable[[], Any], hlo_text: str, calls: int = PROFILE_CALLS
                   ) -> dict[str, float] | None:
  """`call()` once untimed, then `calls` times under `jax.profiler`: the
  device time per call, its GDN part and the attributed share
  (`training.step_split.device_split`); None off a TPU."""
  jax.block_until_ready(call())
  events = profile.trace_calls(call, calls)
  split = step_split.device_split(events, hlo_text, calls=calls)
  if split is None:
    return None
  return dict(device_ms=split["device"] * 1e3, gdn_ms=split[step_split.GDN] * 1e3,
              matched=split["attributed"])


# ---------------------------------------------------------------------------
# Rows


def _compile_step(params, cache, args, cfg: ModelConfig, impl: str, dtype):
  """The program `generation.step` runs for these shapes with
  `implementation=impl` (the cache in the layouts XLA picks for it):
  (compiled, the cache's formats, seconds)."""
  start = time.perf_counter()
  compiled, formats = generation.step_program(
      params, cache, args, generation.statics(cfg, impl, jnp.dtype(dtype)))
  return compiled, formats, time.perf_counter() - start


def _phase_row(floors: timing.Floors, cfg: ModelConfig, params, impl: str, batch: int,
               phase: str, prompt_len: int, n: int, dtype, state_dtype, profiled: bool
               ) -> dict[str, Any]:
  """One (batch, phase) row; raises on failure (the caller makes it a row)."""
  b, p = batch, prompt_len
  calls = WARM + timing.timed_calls(n) + (1 + PROFILE_CALLS if profiled else 0)
  decode = phase == "decode"
  # The last decode call writes position p + calls - 1.
  cache = generation.init_cache(cfg, b + 1, p + (calls if decode else 0), dtype, state_dtype)
  key = jax.random.key(b)
  num_tokens = b if decode else b * p
  tokens = jax.random.randint(key, (num_tokens,), 0, cfg.vocab_size, jnp.int32)
  per_request = 1 if decode else p
  qsl = jnp.arange(b + 1, dtype=jnp.int32) * per_request
  slots = jnp.arange(1, b + 1, dtype=jnp.int32)
  dist = jnp.array([b, b, b] if decode else [0, b, b], jnp.int32)
  args = (tokens, qsl, slots, dist)
  if decode:
    cache = cache._replace(lengths=jnp.asarray([0] + [p] * b, jnp.int32))
  compiled, formats, compile_s = _compile_step(params, cache, args, cfg, impl, dtype)
  state = [generation.placed(cache, formats)]

  def call():
    c = state[0]
    if not decode:       # a fresh prefill every call: no slot has seen a token
      c = generation.placed(
          c._replace(lengths=jnp.zeros((b + 1,), jnp.int32)), formats)
    logits, state[0] = compiled(params, c, *args)
    return logits, state[0]

  ms = timing.wall_ms(call, n=n, warm=WARM)
  row = dict(tokens=num_tokens, ms=ms, tokens_per_s=num_tokens / (ms / 1e3),
             compile_s=compile_s)
  if decode:
    # Timed call i (0-based, after WARM) attends over p + WARM + i + 1
    # positions; the steady state is the cost at `timing.steady_index(n)`.
    kv_positions = p + WARM + timing.steady_index(n) + 1
    hbm = decode_hbm_bytes(cfg, params, b, kv_positions, cache)
    floor = floors.floor_ms(0.0, hbm["total"])
    row.update(kv_positions=kv_positions, hbm_bytes=hbm["total"], weight_bytes=hbm["weights"],
               state_bytes=hbm["states"], kv_bytes=hbm["kv"], floor_ms=floor,
               over_floor=ms / floor)
  if profiled:
    split = _profile_split(call, compiled.as_text())
    if split is not None:
      row.update(device_ms=split["device_ms"], gdn_ms=split["gdn_ms"],
                 gdn_share=split["gdn_ms"] / split["device_ms"] if split["device_ms"] else None,
                 matched=split["matched"])
      if decode and split["device_ms"]:
        row["device_over_floor"] = split["device_ms"] / row["floor_ms"]
  del state, cache
  return row


def generation_rows(floors: timing.Floors, cfg: ModelConfig, params=None,
                    batches: Sequence[int] = (1, 8, 64), prompt_len: int = 128,
                    impls: Sequence[str] = (PALLAS, "xla"), n: int = 20,
                    dtype=jnp.bfloat16, state_dtype=jnp.float32, profiled: bool | None = None,
                    log: Callable[[str], None] = _quiet) -> list[dict[str, Any]]:
  """One row per (implementation, batch, phase): ms per call, tokens/s; a
  decode row adds its HBM floor (`decode_hbm_bytes` at the measured chip's
  rate) and the ratio; with `profiled` (default: on a TPU) the device time
  of a call and the GDN op's share of it.

  params: the model's (default: `decoder.init_params` in `dtype`, random:
  the step's time does not depend on the values). A row that fails (an
  implementation that cannot run here, out of memory) carries `error`
  instead of a time, and the others still run. `log` gets a line before each
  compile and after each row.
  """
  if profiled is None:
    profiled = jax.default_backend() == "tpu"
  if params is None:
    params = decoder.init_params(jax.random.key(0), cfg, dtype)
  rows = []
  for impl in impls:
    for b in batches:
      for phase in ("prefill", "decode"):
        row = dict(table="generation", model=cfg.name, impl=impl, batch=b, phase=phase,
                   prompt_len=prompt_len)
        log(f"generation {impl} B={b} {phase}: compiling")
        try:
          row.update(_phase_row(floors, cfg, params, impl, b, phase, prompt_len, n, dtype,
                                state_dtype, profiled))
        except Exception as e:  # pylint: disable=broad-except
          row.update(ms=None, error=_error(e))
        rows.append(row)
        log(_done(row))
  return rows

