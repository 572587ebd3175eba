"""tokamax 0.0.17's own tests of its serving op, pointed at ours.

tokamax's `test_base.py` (the shared suite every implementation subclasses
with its callable) and `gdn_attention_test.py` (its Pallas kernel's tests
against eager per-request oracles) are run unchanged, with our op as the
callable under test: `gdn_fn` for the test-base classes, the module's
`wrapper.fused_conv1d_gdn` for the kernel tests (its tiling keywords are
hints for tokamax's kernel and are dropped), and their TPU-only gate
lifted. A selection of the cheapest cases runs in the suite (their shapes
are tokamax's: Hk=2, Hv=8, K=V=128); the rest, up to 520-token batches and
512-request padded decodes, pass by hand (see the branch report). Skips if
tokamax's test modules cannot be imported.
"""

import unittest

import pytest

tokamax_test_base = pytest.importorskip(
    "tokamax._src.ops.causal_conv1d_gated_delta_rule.test_base")
tokamax_kernel_tests = pytest.importorskip(
    "tokamax._src.ops.causal_conv1d_gated_delta_rule.gdn_attention_test")

from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import api  # pylint: disable=g-import-not-at-top,wrong-import-position


def _ours(impl):
  def gdn_fn(*args, mixed_tile_size=None, decode_tile_size=None, **kwargs):
    del mixed_tile_size, decode_tile_size   # tokamax kernel's tiling hints
    return api.causal_conv1d_gated_delta_rule(*args, **kwargs, implementation=impl)
  return gdn_fn


def _run(case: unittest.TestCase) -> None:
  result = unittest.TestResult()
  case.run(result)
  problems = result.errors + result.failures
  assert not problems, problems[0][1]
  assert not result.skipped, result.skipped
  assert result.testsRun == 1


# (class, method): each at most a few CPU-seconds per implementation.
CASES = [
    ("base", "test_has_initial_state_zeros_stale_slot"),
    ("security", "test_security_isolation"),
    ("kernel", "test_split_read_write_state_slots"),
    ("kernel", "test_per_seq_rolls_read_offsets_with_start_seq"),
    ("kernel", "test_spec_mode_checkpoints_spec_windows"),
]


@pytest.mark.parametrize("impl", ["xla", "reference"])
@pytest.mark.parametrize("kind,method", CASES, ids=[c[1] for c in CASES])
def test_tokamax_case(impl, kind, method, monkeypatch):
  gdn_fn = _ours(impl)
  monkeypatch.setattr(tokamax_test_base, "skip_if_unsupported", lambda case: None)
  if kind == "base":
    case = type("Ours", (tokamax_test_base.CausalConv1dGatedDeltaRuleTestBase,), {})(
        method, gdn_fn=gdn_fn)
  elif kind == "security":
    case = type("Ours", (tokamax_test_base.CausalConv1dGatedDeltaRuleSecurityTestBase,), {})(
        method, gdn_fn=gdn_fn)
  else:
    monkeypatch.setattr(tokamax_kernel_tests, "wrapper",
                        type("Wrapper", (), {"fused_conv1d_gdn": staticmethod(gdn_fn)}))
    # Their setUp only gates on a TPU v6+.
    case = type("Ours", (tokamax_kernel_tests.GDNAttentionTest,),
                {"setUp": unittest.TestCase.setUp})(method)
  _run(case)
