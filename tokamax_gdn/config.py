"""Process-wide switches: Pallas interpret mode and the TPU generation to target.

Interpret mode lets the `pallas_mosaic_tpu` kernels run on CPU (Pallas TPU
interpret mode). It is on when the environment variable `TOKAMAX_GDN_INTERPRET`
is `1`/`true`, or when set with `set_interpret(True)` / `with interpret_mode():`.

The TPU generation matters for tiling heuristics (VMEM size, MXU width). On a
TPU it is read from the device; under an abstract mesh of a TPU topology (AOT
compiles on CPU) from that mesh; otherwise from `TOKAMAX_GDN_TARGET_CHIP` or
`set_target_chip(...)`, defaulting to v6e.
"""

import contextlib
import dataclasses
import os
import threading

import jax

_state = threading.local()


def skip_tpu_backend_without_chips() -> None:
  """Keeps jax from starting libtpu's TPU client on a machine without TPU chips.

  With libtpu installed (the `tpu` and `test` extras, for AOT compiles), jax
  starts its TPU backend at the first device query even where there is no
  chip; that fails quietly after libtpu has printed start-up errors ("Failed
  to find host bounds", "unexpected worker hostname"). As jax itself skips
  CUDA without an NVIDIA GPU, this makes the TPU backend fail at once (quietly,
  without loading libtpu) when no TPU chip is present, unless JAX_PLATFORMS or
  JAX_FORCE_TPU_INIT say otherwise. The backend stays registered, so TPU
  lowering rules still apply. Compiling
  for a TPU target (`tokamax_gdn.aot`) still loads libtpu when asked, through
  `jax.experimental.topologies`. Called when `tokamax_gdn` is imported; does
  nothing once jax's backends are up.
  """
  if (os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
      or "JAX_FORCE_TPU_INIT" in os.environ):
    return
  try:
    from jax._src import hardware_utils  # pylint: disable=g-import-not-at-top
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    if xla_bridge.backends_are_initialized():
      return
    registration = xla_bridge._backend_factories.get("tpu")  # pylint: disable=protected-access
    if registration is None or hardware_utils.num_available_tpu_chips_and_device_id()[0]:
      return
  except (ImportError, AttributeError):  # another jax: leave its backends as they are
    return

  def no_chip():
    raise RuntimeError("no TPU chip on this machine (tokamax_gdn: libtpu not started)")

  xla_bridge._backend_factories["tpu"] = dataclasses.replace(registration, factory=no_chip)  # pylint: disable=protected-access


def _env_flag(name: str) -> bool:
  return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def interpret_enabled() -> bool:
  """Whether Pallas TPU kernels should run in interpret mode."""
  override = getattr(_state, "interpret", None)
  if override is not None:
    return override
  return _env_flag("TOKAMAX_GDN_INTERPRET")


def set_interpret(enabled: bool | None) -> None:
  """Sets interpret mode for this thread (None: back to the environment)."""
  _state.interpret = enabled


@contextlib.contextmanager
def interpret_mode(enabled: bool = True):
  """Context manager form of `set_interpret`."""
  prev = getattr(_state, "interpret", None)
  _state.interpret = enabled
  try:
    yield
  finally:
    _state.interpret = prev


@dataclasses.dataclass(frozen=True, slots=True)
class TpuGeneration:
  """What the tiling heuristics and the AOT roofline need to know about a TPU generation.

  `peak_flops_per_cycle` and `hbm_bytes_per_cycle` are on the scale of the
  compiler's static cycle estimate (what `tokamax-gdn aot` reports), measured
  with that estimator by `tokamax_gdn.aot.calibrate`: a 4096^3 bf16 matmul
  (2*4096^3 FLOPs over its estimated cycles) and a 64 MiB bf16 copy (bytes read
  + written over its cycles), each in its best tiling. None: not calibrated.
  """

  name: str            # short name: v5e, v6e, v5p, tpu7x
  topology: str        # topology name for `jax.experimental.topologies`
  vmem_bytes: int      # physical VMEM per TensorCore
  mxu: int             # MXU edge (128 on v5e/v5p, 256 on v6e/tpu7x)
  device_kinds: tuple[str, ...]  # `device.device_kind` strings seen for it
  peak_flops_per_cycle: float | None = None  # bf16 MXU peak, estimator scale
  hbm_bytes_per_cycle: float | None = None   # HBM read + write rate, estimator scale


# Peaks measured with `tokamax_gdn.aot.calibrate` (libtpu 0.0.50, static cycle
# estimate): FLOP/cycle of the 4096^3 bf16 matmul in 1024^3 tiles (v5e 1103444
# cycles, v6e 309221, tpu7x 308551, v5p 552743) and bytes/cycle of the 64 MiB
# copy in its best block (v5e 116278 cycles at 4096 rows, v6e 72286 at 4096,
# tpu7x 38104 at 4096, v5p 28465 at 2048).
TPU_GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v5e", "v5e:2x2", 128 << 20, 128, ("TPU v5 lite", "TPU v5e"),
                      peak_flops_per_cycle=124554.5, hbm_bytes_per_cycle=1154.28),
        TpuGeneration("v6e", "v6e:2x2", 128 << 20, 256, ("TPU v6 lite", "TPU v6e"),
                      peak_flops_per_cycle=444468.4, hbm_bytes_per_cycle=1856.76),
        TpuGeneration("v5p", "v5p:2x2x1", 95 << 20, 128, ("TPU v5", "TPU v5p"),
                      peak_flops_per_cycle=248648.9, hbm_bytes_per_cycle=4715.18),
        TpuGeneration("tpu7x", "tpu7x:2x2x1", 64 << 20, 256, ("TPU7x", "TPU 7x", "TPU v7"),
                      peak_flops_per_cycle=445433.5, hbm_bytes_per_cycle=3522.41),
    )
}
DEFAULT_TARGET_CHIP = "v6e"


def set_target_chip(name: str | None) -> None:
  """Sets the TPU generation assumed when no TPU device or mesh says otherwise."""
  if name is not None and name not in TPU_GENERATIONS:
    raise ValueError(f"Unknown TPU generation {name!r}; valid: {sorted(TPU_GENERATIONS)}")
  _state.target_chip = name


def generation_from_device_kind(device_kind: str) -> TpuGeneration | None:
  """Maps a `device_kind` string to a known TPU generation (None if not a TPU)."""
  kind = device_kind.strip()
  # Longest match first: "TPU v5 lite" must not be taken for "TPU v5".
  candidates = sorted(
      ((k, g) for g in TPU_GENERATIONS.values() for k in g.device_kinds),
      key=lambda kg: -len(kg[0]),
  )
  for k, g in candidates:
    if kind.lower().startswith(k.lower()):
      return g
  return None


def current_device_kind() -> str:
  """The device kind an op traced now would run on (abstract mesh first)."""
  mesh = jax.sharding.get_abstract_mesh()
  device = getattr(mesh, "abstract_device", None)
  if device is not None:
    return device.device_kind
  return jax.devices()[0].device_kind


def target_generation() -> TpuGeneration:
  """The TPU generation to tile for: device / abstract mesh, else the target chip."""
  gen = generation_from_device_kind(current_device_kind())
  if gen is not None:
    return gen
  name = getattr(_state, "target_chip", None) or os.environ.get(
      "TOKAMAX_GDN_TARGET_CHIP", DEFAULT_TARGET_CHIP
  )
  if name not in TPU_GENERATIONS:
    raise ValueError(f"TOKAMAX_GDN_TARGET_CHIP={name!r}; valid: {sorted(TPU_GENERATIONS)}")
  return TPU_GENERATIONS[name]


def on_tpu() -> bool:
  """True when ops traced now target a TPU (a real one or an AOT topology)."""
  return generation_from_device_kind(current_device_kind()) is not None


class PallasTpuUnavailableError(NotImplementedError):
  """A `pallas_mosaic_tpu` implementation called where its kernels cannot run:
  off a TPU with interpret mode off. A NotImplementedError, so that a sequence
  `implementation=("pallas_mosaic_tpu", "xla")` falls through to the next one."""


def pallas_tpu_unavailable(op_name: str, device_kind: str,
                           op_class: str | None = None) -> PallasTpuUnavailableError:
  """The error for `op_name`'s `pallas_mosaic_tpu` implementation (its tokamax
  Op class `op_class`, e.g. the backward's) called on a `device_kind` device."""
  which = f" ({op_class})" if op_class else ""
  return PallasTpuUnavailableError(
      f"{op_name}: implementation 'pallas_mosaic_tpu'{which} needs a TPU, and this call"
      f" runs on {device_kind}. To run its kernels here in Pallas TPU interpret mode (slow: for"
      " testing), set TOKAMAX_GDN_INTERPRET=1 or call it inside"
      " `with tokamax_gdn.config.interpret_mode():`. Or choose implementation='xla', or a"
      " sequence such as ('pallas_mosaic_tpu', 'xla') that falls back.")


def require_pallas_tpu(op_name: str) -> bool:
  """Where a Pallas TPU kernel runs: returns whether in interpret mode, or raises.

  On a TPU (a real chip, or an AOT target's abstract mesh) the kernel is
  compiled for it: False, even with interpret mode on. Elsewhere it runs in
  Pallas TPU interpret mode when that is on (`interpret_mode()`,
  `TOKAMAX_GDN_INTERPRET=1`): True. Otherwise `PallasTpuUnavailableError`
  naming the op `op_name`.
  """
  if on_tpu():
    return False
  if interpret_enabled():
    return True
  raise pallas_tpu_unavailable(op_name, current_device_kind())


def pallas_tpu_supported(device: jax.Device) -> bool:
  """`supported_on` of every `pallas_mosaic_tpu` Op: a TPU, or any device in
  interpret mode (the same kernels then run in Pallas TPU interpret mode)."""
  return device.platform == "tpu" or interpret_enabled()
