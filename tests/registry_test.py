"""Registry lookup and `implementation=` resolution semantics."""

import jax
import pytest
from tokamax._src.ops import op as op_lib

import tokamax_gdn
from tokamax_gdn import registry
from tokamax_gdn.ops.gated_delta_rule.arg_specs import random_inputs


def test_ops_listed_and_implementations_are_ops():
  assert registry.list_ops() == ["gated_delta_rule", "causal_conv1d", "gmm", "tgmm",
                                 "causal_conv1d_gated_delta_rule", "gated_rmsnorm"]
  # Registration is by module discovery: a lost module would otherwise only
  # shrink the parametrised suites. (The serving op's Pallas kernel may land
  # separately from its reference and xla.)
  found = {o: sorted(registry.implementations(o)) for o in registry.list_ops()}
  assert set(found.pop("causal_conv1d_gated_delta_rule")) >= {"reference", "xla"}
  assert found == {o: ["pallas_mosaic_tpu", "reference", "xla"] for o in found}
  for op_name in registry.list_ops():
    for name, impl in registry.implementations(op_name).items():
      assert name in registry.IMPLEMENTATION_NAMES
      assert isinstance(impl, op_lib.Op)
      assert registry.get(op_name, name) is impl


def test_unknown_names_are_value_errors_listing_valid_ones():
  with pytest.raises(ValueError, match="gated_delta_rule"):
    registry.implementations("nope")
  with pytest.raises(ValueError, match="reference"):
    registry.get("gated_delta_rule", "nope")
  args, kwargs = random_inputs(jax.random.key(0), b=1, t=4, hk=1, hv=1, dk=4, dv=4)
  with pytest.raises(ValueError, match="reference"):
    tokamax_gdn.gated_delta_rule(*args, **kwargs, implementation="triton")
  with pytest.raises(ValueError, match="empty"):
    tokamax_gdn.gated_delta_rule(*args, **kwargs, implementation=())


def test_default_order_off_tpu():
  order = registry.default_order("gated_delta_rule")
  assert "pallas_mosaic_tpu" not in order
  assert order[-1] == "reference"


class _Refuses(op_lib.Op):
  def _fwd(self, *args, config, **kwargs):
    raise NotImplementedError("refused on purpose")

  def bind(self, *args, **kwargs):
    raise NotImplementedError("refused on purpose")


def test_sequence_falls_through_on_not_implemented_and_groups_failures():
  args, kwargs = random_inputs(jax.random.key(0), b=1, t=4, hk=1, hv=1, dk=4, dv=4)
  out, _ = tokamax_gdn.gated_delta_rule(*args, **kwargs,
                                        implementation=[_Refuses(), "reference"])
  assert out.shape == (1, 4, 1, 4)
  with pytest.raises(ExceptionGroup) as info:
    tokamax_gdn.gated_delta_rule(*args, **kwargs, implementation=[_Refuses(), _Refuses()])
  assert len(info.value.exceptions) == 2


def test_pallas_off_tpu_without_interpret_is_not_implemented():
  assert "pallas_mosaic_tpu" in registry.implementations("gated_delta_rule")
  args, kwargs = random_inputs(jax.random.key(0), b=1, t=8, hk=1, hv=1, dk=16, dv=16)
  with tokamax_gdn.config.interpret_mode(False):
    # A single name raises its own error (`except NotImplementedError` catches it).
    with pytest.raises(NotImplementedError) as info:
      tokamax_gdn.gated_delta_rule(*args, **kwargs, implementation="pallas_mosaic_tpu")
    assert not isinstance(info.value, ExceptionGroup)
