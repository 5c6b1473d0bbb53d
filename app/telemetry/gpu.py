"""The GPU through NVML (nvidia-ml-py): SM clock and its maximum, temperature, power,
clock-throttle reason bits and memory. Reads nothing (an empty reading) where there is no
GPU, no driver or no `pynvml`. NVML is opened and read on the sampler thread
(`background.py`: a driver call costs microseconds to milliseconds), every 50 ms; the loop
reads the latest sample.

NVML numbers every GPU of the machine in PCI order and ignores `CUDA_VISIBLE_DEVICES` (and
CUDA's own order, fastest first): with `CUDA_VISIBLE_DEVICES=2`, CUDA's device 0 is NVML's
device 2. The handle is found by the CUDA device's UUID, else its PCI bus id (a MIG instance's
UUID is not a GPU's: its GPU's bus id finds the GPU), both as torch reports them once the
compute threads have initialised CUDA; until then the probe reads nothing.

Each field is read on its own, so one failing query costs that field alone: one this GPU
or driver does not support (power on some boards) is left out for good, logged once; any
other error leaves it out of that sample and it is retried after 1, 2, 4 ... samples (at
most `MAX_RETRY_SKIP_SAMPLES`). Only a GPU that NVML reports lost ends every reading: the
engine's GPU gauges turn NaN and `SteadyserveGpuReadingsLost` fires (the device cannot
compute until the node is repaired).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.telemetry.background import BackgroundProbe

log = logging.getLogger(__name__)

# NVML's clock-throttle ("clocks event") reason bits, as attribution names them.
THROTTLE_REASONS = {
    0x1: "idle",
    0x2: "application clocks setting",
    0x4: "software power cap",
    0x8: "hardware slowdown",
    0x10: "sync boost",
    0x20: "software thermal",
    0x40: "hardware thermal",
    0x80: "hardware power brake",
    0x100: "display clock setting",
}
# Bits that slow a busy GPU down (idle and settings the operator chose are not throttling).
SLOWDOWN_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


# A field failing transiently skips 1, 2, 4 ... samples before its next try, at most this
# many (5 s at 50 ms a sample): a GPU busy in a driver call is not asked 20 times a second.
MAX_RETRY_SKIP_SAMPLES = 100

# NVML's error codes (nvml.h), where `pynvml` lacks the constant.
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15


def throttle_reason_names(bits: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


def _sm_clock(nvml: Any, handle: Any) -> Mapping[str, float]:
    return {"gpu_sm_clock_hertz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6}


def _sm_clock_max(nvml: Any, handle: Any) -> Mapping[str, float]:
    clock = nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
    return {"gpu_sm_clock_max_hertz": clock * 1e6}


def _temperature(nvml: Any, handle: Any) -> Mapping[str, float]:
    celsius = nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
    return {"gpu_temperature_celsius": float(celsius)}


def _power(nvml: Any, handle: Any) -> Mapping[str, float]:
    return {"gpu_power_watts": nvml.nvmlDeviceGetPowerUsage(handle) / 1000}


def _throttle_reasons(nvml: Any, handle: Any) -> Mapping[str, float]:
    # Renamed "clocks event reasons" in newer drivers and nvidia-ml-py.
    reader = getattr(nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
        nvml.nvmlDeviceGetCurrentClocksThrottleReasons
    )
    return {"gpu_throttle_reasons": float(reader(handle))}


def _memory(nvml: Any, handle: Any) -> Mapping[str, float]:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    return {
        "gpu_memory_used_bytes": float(memory.used),
        "gpu_memory_free_bytes": float(memory.free),
    }


# Each field: one NVML query, and the readings it gives.
FIELDS: dict[str, Callable[[Any, Any], Mapping[str, float]]] = {
    "SM clock": _sm_clock,
    "SM clock maximum": _sm_clock_max,
    "temperature": _temperature,
    "power": _power,
    "throttle reasons": _throttle_reasons,
    "memory": _memory,
}


@dataclass(frozen=True, slots=True)
class DeviceIds:
    """How NVML can find one CUDA device, in NVML's forms."""

    uuid: str | None  # "GPU-<uuid>"
    pci_bus_id: str | None  # "<domain>:<bus>:<device>.0", hexadecimal


def cuda_device_ids(device_index: int) -> DeviceIds | None:
    """CUDA device `device_index`'s ids as torch reports them; None while CUDA is not
    initialised (reading a device's properties would initialise it, on the calling thread,
    before the compute threads do). Any thread."""
    import torch

    if not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        return None
    properties = torch.cuda.get_device_properties(device_index)
    uuid = getattr(properties, "uuid", None)
    domain, bus, device = (
        getattr(properties, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
    )
    return DeviceIds(
        uuid=None if uuid is None else f"GPU-{uuid}",
        pci_bus_id=None
        if None in (domain, bus, device)
        else f"{domain:08x}:{bus:02x}:{device:02x}.0",
    )


def _code(nvml: Any, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    return value if isinstance(value, int) else default


class NvmlProbe(BackgroundProbe):
    """`sample()`: the sampler thread only (NVML is opened there, on the first sample);
    `read()`: any thread. `device_index` None: the probe reads nothing."""

    sample_every_s = 0.05

    def __init__(
        self,
        device_index: int | None,
        device_ids: Callable[[int], DeviceIds | None] = cuda_device_ids,
    ) -> None:
        super().__init__()
        self._device_index = device_index
        self._device_ids = device_ids
        self._opened = False  # tried: NVML is opened once, or never
        self._nvml: Any | None = None
        self._handle: Any | None = None
        self._lost = False
        self._unsupported: set[str] = set()
        self._failures: dict[str, int] = {}  # field -> failures in a row
        self._skip: dict[str, int] = {}  # field -> samples to skip before its next try

    def _open(self, device_index: int) -> None:
        """Find the device's NVML handle, once its ids are known (CUDA initialised)."""
        try:
            ids = self._device_ids(device_index)
        except Exception as error:  # no torch, no such device
            log.info("CUDA device %d unknown to torch (%r): no GPU telemetry", device_index, error)
            self._opened = True
            return
        if ids is None:
            return  # CUDA not initialised yet: asked again at the next sample
        self._opened = True
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception as error:  # no library, no driver
            log.info("NVML unavailable (%s): no GPU telemetry", type(error).__name__)
            return
        self._handle = self._find(pynvml, ids)
        if self._handle is None:
            log.warning(
                "NVML has no GPU with CUDA device %d's UUID %s or PCI bus id %s: no GPU telemetry",
                device_index,
                ids.uuid,
                ids.pci_bus_id,
            )
            return
        self._nvml = pynvml

    @staticmethod
    def _find(nvml: Any, ids: DeviceIds) -> Any | None:
        lookups = (
            (ids.uuid, nvml.nvmlDeviceGetHandleByUUID),
            (ids.pci_bus_id, nvml.nvmlDeviceGetHandleByPciBusId),
        )
        for key, lookup in lookups:
            if key is None:
                continue
            try:
                return lookup(key)
            except Exception as error:  # not found (a MIG instance's UUID): the next way
                log.debug("NVML lookup of %s failed (%r)", key, error)
        return None

    @property
    def available(self) -> bool:
        return self._nvml is not None and not self._lost

    def sample(self) -> Mapping[str, float]:
        if self._device_index is None or self._lost:
            return {}
        if not self._opened:
            self._open(self._device_index)
        if self._nvml is None:
            return {}
        readings: dict[str, float] = {}
        for field, reader in FIELDS.items():
            if field in self._unsupported:
                continue
            if self._skip.get(field, 0) > 0:
                self._skip[field] -= 1
                continue
            try:
                readings.update(reader(self._nvml, self._handle))
            except Exception as error:
                if self._failed(field, error):
                    return {}  # the GPU is lost: nothing it read is worth keeping
                continue
            if self._failures.pop(field, 0):
                log.info("NVML reads the GPU's %s again", field)
        return readings

    def _failed(self, field: str, error: Exception) -> bool:
        """Note `field`'s failure; whether it says the GPU is lost."""
        nvml, code = self._nvml, getattr(error, "value", None)
        if code == _code(nvml, "NVML_ERROR_GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST):
            log.error("NVML: the GPU is lost (%s): every GPU reading is NaN from now on", error)
            self._lost = True
            return True
        unsupported = {
            _code(nvml, "NVML_ERROR_NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED),
            _code(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND),
            _code(nvml, "NVML_ERROR_NO_PERMISSION", NVML_ERROR_NO_PERMISSION),
        }
        if code in unsupported or isinstance(error, AttributeError):
            # Will not change while the engine runs: left out, not retried.
            log.info("NVML cannot read the GPU's %s here (%s): left out", field, error)
            self._unsupported.add(field)
            return False
        failures = self._failures[field] = self._failures.get(field, 0) + 1
        self._skip[field] = min(2 ** (failures - 1), MAX_RETRY_SKIP_SAMPLES)
        if failures == 1:  # once per run of failures, not 20 lines a second
            log.warning("NVML read of the GPU's %s failed (%r): retrying", field, error)
        return False
