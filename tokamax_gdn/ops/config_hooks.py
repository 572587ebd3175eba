"""The tokamax Op hooks that every implementation answers the same way.

An implementation module chooses its Config with two functions of the call's
bound arguments (a heuristic choice, and the set autotuning times); tokamax
asks for them through `Op._get_heuristics_config` / `_get_autotuning_configs`.
`ConfigHooks` answers both from class attributes naming those functions, so an
Op and its VJP that tile alike name the same two functions instead of each
writing out both overrides. `PallasTpuHooks` adds the `supported_on` of every
`pallas_mosaic_tpu` Op (a TPU, or any device in interpret mode) and the error
for a device it does not support.
"""

from collections.abc import Callable
import contextvars
from typing import Any, ClassVar

import jax
from tokamax._src.ops import op
from typing_extensions import override

from tokamax_gdn import config as gdn_config


def of_size(fn: Callable[[int], Any], argument: str, axis: int) -> Callable[..., Any]:
  """A config function of one size (e.g. T) as a function of the bound arguments:
  `fn(ba.arguments[argument].shape[axis])`."""
  return lambda ba: fn(ba.arguments[argument].shape[axis])


class ConfigHooks:
  """Op mixin (listed before the Op base): the Config hooks call `heuristics(ba)`
  and `autotuning_configs(ba)`, functions the implementation class names.

  They are read from the class, so a plain function assigned in the class
  body is called as it is, not bound to the Op.
  """

  heuristics: ClassVar[Callable[[op.BoundArguments], Any]]
  autotuning_configs: ClassVar[Callable[[op.BoundArguments], set[Any]]]

  @override
  def _get_heuristics_config(self, ba: op.BoundArguments) -> Any:
    return type(self).heuristics(ba)

  @override
  def _get_autotuning_configs(self, ba: op.BoundArguments) -> set[Any]:
    return type(self).autotuning_configs(ba)


# True while a `PallasTpuHooks` Op's `__call__` runs: tokamax's device check in
# there then gets our error from `supported_on` instead of a False.
_in_call = contextvars.ContextVar("tokamax_gdn_pallas_op_call", default=False)


class PallasTpuHooks(ConfigHooks):
  """`ConfigHooks` of a `pallas_mosaic_tpu` Op, which runs on a TPU or, in Pallas
  TPU interpret mode, on any device (`config.pallas_tpu_supported`).

  Called on another device it raises `config.PallasTpuUnavailableError`, which
  names the op (`op_name`, the public op the class implements a part of) and
  how to turn interpret mode on, where tokamax's `Op.__call__` would raise its
  bare "Not supported on cpu." (both are NotImplementedError, on which an
  `implementation=` sequence falls through). It comes from tokamax's own check,
  so in tokamax's order: after `bind`'s errors for bad arguments. Asked
  outside a call (tokamax's autotuner filters implementations so),
  `supported_on` answers False.
  """

  op_name: ClassVar[str]

  @override
  def supported_on(self, device: jax.Device) -> bool:
    if gdn_config.pallas_tpu_supported(device):
      return True
    if _in_call.get():
      raise gdn_config.pallas_tpu_unavailable(self.op_name, device.device_kind,
                                              type(self).__name__)
    return False

  def __call__(self, *args, **kwargs):
    token = _in_call.set(True)
    try:
      return super().__call__(*args, **kwargs)
    finally:
      _in_call.reset(token)
