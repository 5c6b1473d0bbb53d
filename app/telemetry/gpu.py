"""The GPU through NVML (nvidia-ml-py): SM clock and its maximum, temperature, power,
clock-throttle reason bits and memory. Reads nothing (an empty reading) where there is no
GPU, no driver or no `pynvml`; a failing call disables the probe rather than raising on the
request path. NVML is opened and read on the sampler thread (`background.py`: a driver call
costs microseconds to milliseconds), every 50 ms; the loop reads the latest sample.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
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


def throttle_reason_names(bits: int) -> list[str]:
    return [name for bit, name in THROTTLE_REASONS.items() if bits & bit]


class NvmlProbe(BackgroundProbe):
    """`sample()`: the sampler thread only (NVML is opened there, on the first sample);
    `read()`: any thread. `device_index` None: the probe reads nothing."""

    sample_every_s = 0.05

    def __init__(self, device_index: int | None) -> None:
        super().__init__()
        self._device_index = device_index
        self._opened = False
        self._nvml: Any | None = None
        self._handle: Any | None = None

    def _open(self, device_index: int) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
            self._nvml = pynvml
        except Exception as error:  # no library, no driver, no such device
            log.info("NVML unavailable (%s): no GPU telemetry", type(error).__name__)
            self._nvml = self._handle = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def _throttle_bits(self) -> int:
        assert self._nvml is not None
        reader = getattr(self._nvml, "nvmlDeviceGetCurrentClocksEventReasons", None) or (
            self._nvml.nvmlDeviceGetCurrentClocksThrottleReasons
        )
        return int(reader(self._handle))

    def sample(self) -> Mapping[str, float]:
        if self._device_index is None:
            return {}
        if not self._opened:
            self._opened = True
            self._open(self._device_index)
        nvml, handle = self._nvml, self._handle
        if nvml is None:
            return {}
        try:
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            return {
                "gpu_sm_clock_hertz": nvml.nvmlDeviceGetClockInfo(handle, nvml.NVML_CLOCK_SM) * 1e6,
                "gpu_sm_clock_max_hertz": nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM)
                * 1e6,
                "gpu_temperature_celsius": float(
                    nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
                ),
                "gpu_power_watts": nvml.nvmlDeviceGetPowerUsage(handle) / 1000,
                "gpu_throttle_reasons": float(self._throttle_bits()),
                "gpu_memory_used_bytes": float(memory.used),
                "gpu_memory_free_bytes": float(memory.free),
            }
        except Exception as error:
            log.warning("NVML read failed (%s): GPU telemetry off", type(error).__name__)
            self._nvml = None
            return {}
