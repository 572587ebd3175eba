"""The xla serving op against tokamax's and our references (test_base), and
its pools updated in place under jit with donation."""

import re

import jax
import jax.numpy as jnp

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import xla

from .test_base import F32, STATIC, TINY, ServingTestBase, assert_close, make  # pylint: disable=relative-beyond-top-level


class TestXla(ServingTestBase):
  IMPL = "xla"


def _pool_copies(hlo: str, shapes) -> list[str]:
  """HLO `copy` instructions whose result has one of the pools' shapes."""
  found = []
  for line in hlo.splitlines():
    m = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} copy\(", line)
    if m and tuple(int(d) for d in m.group(2).split(",") if d) in shapes:
      found.append(line.strip())
  return found


def test_donated_pools_are_updated_in_place():
  """Under jit with the pools donated, the optimised program copies no pool
  and its outputs alias the donated buffers (both pools; bf16, the usual
  serving dtype: one optimised compile)."""
  for state_dtype in (jnp.bfloat16,):
    lay = arg_specs.layout(lengths=[1, 1, 1, 40, 9], context_lens=[3, 3, 3, 0, 2], max_reqs=8,
                           dtype=jnp.float32, state_dtype=state_dtype, **TINY)
    args, _ = make(lay)
    static = {n: lay[n] for n in STATIC if n in lay}

    def step(conv, rec, rest):
      return api.causal_conv1d_gated_delta_rule(*rest[:3], conv, rec, *rest[3:], **static,
                                                implementation="xla")

    rest = args[:3] + args[5:]
    # The optimised program is what runs in production (the suite compiles
    # without the optimisation pipeline, conftest.py).
    prev = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", False)
    try:
      compiled = jax.jit(step, donate_argnums=(0, 1)).lower(args[3], args[4], rest).compile()
    finally:
      jax.config.update("jax_disable_most_optimizations", prev)
    hlo = compiled.as_text()
    assert not _pool_copies(hlo, {args[3].shape, args[4].shape}), _pool_copies(
        hlo, {args[3].shape, args[4].shape})
    aliases = re.search(r"input_output_alias=\{([^\n]*)\}", hlo)
    assert aliases and aliases.group(1).count("may-alias") + aliases.group(1).count(
        "must-alias") >= 2, aliases


def test_several_tiles_per_request():
  """Requests longer than a tile (2 and 1 tiles of 64 tokens, chunks of 16)
  carry conv window and state across tiles; a decode in front."""
  lay = arg_specs.layout(lengths=[1, 70, 40], context_lens=[3, 0, 6], **TINY, **F32)
  args, kwargs = make(lay, seed=11)
  impl = xla.IMPLEMENTATION.replace(config=xla.Config(tile_size=64, chunk_size=16))
  static = {k: v for k, v in kwargs.items() if k in STATIC}
  (conv, rec), out = jax.jit(lambda a: impl(*a, **static))(args)
  (r_conv, r_rec), r_out = jax.jit(lambda a: api.causal_conv1d_gated_delta_rule(
      *a, **static, implementation="reference"))(args)
  assert_close(out, r_out, jnp.float32, "out")
  assert_close(rec, r_rec, jnp.float32, "recurrent")
  assert_close(conv, r_conv, jnp.float32, "conv")
