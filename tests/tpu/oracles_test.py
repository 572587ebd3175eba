"""`tests/tpu/oracles.py` on CPU: a child process computes cases' inputs and
oracles in order, handed over as `test_base.compute_expected` gives them
here; a case it fails on, or one it does not have, is left to the caller."""

import json

import jax
import numpy as np

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs
from tests.ops.causal_conv1d_gated_delta_rule import test_base
from tests.tpu import oracles
from tests.tpu import progress
from tests.tpu import runner


def test_a_child_hands_over_what_computing_here_gives(tmp_path, monkeypatch):
  log = tmp_path / "results.jsonl"
  monkeypatch.setenv(progress.ENV, str(log))
  # The child compiles as this suite does (tests/conftest.py), in half the time.
  monkeypatch.setenv("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")
  children = oracles.Children(["no_such_workload", "tiny_decode_8_ctx"], 1)
  try:
    got = {name: children.take(name)
           for name in ("no_such_workload", "tiny_decode_8_ctx", "not_given")}
  finally:
    children.close()
  assert got["no_such_workload"] is None and got["not_given"] is None
  # The child's compiles reach the runner's summary through the log.
  lines = [json.loads(line) for line in log.read_text().splitlines()]
  assert [r["event"] for r in lines] == ["oracles"] and lines[0]["cases"] == 2
  assert runner.compile_totals(lines)["oracles"]["programs"] >= 2
  here = test_base.compute_expected(arg_specs.layout_of("tiny_decode_8_ctx"))
  there = got["tiny_decode_8_ctx"]
  assert jax.tree.structure(there) == jax.tree.structure(here)
  for a, b in zip(jax.tree.leaves(there), jax.tree.leaves(here)):
    np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                               rtol=1e-5, atol=1e-6)
