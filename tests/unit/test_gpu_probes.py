"""The GPU probes against a fake NVML (`pynvml` replaced in `sys.modules`) and a fake CUDA
(torch.cuda's functions replaced): this machine has neither. Where the slow reads run (the
sampler thread, never the loop); the sampler's own schedule and life are
tests/unit/test_probe_sampler.py's."""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
import torch

from app.metrics import Metrics
from app.telemetry.background import SAMPLER_THREAD_NAME
from app.telemetry.cuda import CudaAllocatorProbe
from app.telemetry.gpu import NvmlProbe
from app.telemetry.sampler import ProcessTelemetry
from tests.support.manual_clock import ManualClock

NOT_SUPPORTED, NOT_FOUND, GPU_IS_LOST, UNKNOWN = 3, 6, 15, 999


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


@dataclass
class FakeGpu:
    """One physical GPU as NVML sees it."""

    uuid: str
    pci_bus_id: str
    sm_clock_mhz: int = 1980
    temperature_c: int = 40
    # Errors each NVML function raises, in turn, before it answers again (by name).
    errors: dict[str, list[int]] = field(default_factory=dict)
    # Functions that raise `NOT_SUPPORTED` every time.
    unsupported: set[str] = field(default_factory=set)


class FakeNvml:
    """The parts of `pynvml` the probe calls, over a list of GPUs in NVML's (PCI) order;
    records each call with the thread that made it."""

    NVML_CLOCK_SM = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_NO_PERMISSION = 4
    NVML_ERROR_GPU_IS_LOST = GPU_IS_LOST
    NVMLError = FakeNvmlError

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.calls: list[tuple[str, str]] = []  # (function, thread name)

    def _call(self, function: str, gpu: FakeGpu | None = None) -> None:
        self.calls.append((function, threading.current_thread().name))
        if gpu is None:
            return
        if function in gpu.unsupported:
            raise FakeNvmlError(NOT_SUPPORTED)
        pending = gpu.errors.get(function)
        if pending:
            raise FakeNvmlError(pending.pop(0))

    def calls_to(self, function: str) -> int:
        return sum(1 for name, _ in self.calls if name == function)

    def nvmlInit(self) -> None:
        self._call("nvmlInit")

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByIndex")
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByUUID")
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        raise FakeNvmlError(NOT_FOUND)

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByPciBusId")
        for gpu in self.gpus:
            if gpu.pci_bus_id == bus_id:
                return gpu
        raise FakeNvmlError(NOT_FOUND)

    def nvmlDeviceGetClockInfo(self, gpu: FakeGpu, kind: int) -> int:
        self._call("nvmlDeviceGetClockInfo", gpu)
        return gpu.sm_clock_mhz

    def nvmlDeviceGetMaxClockInfo(self, gpu: FakeGpu, kind: int) -> int:
        self._call("nvmlDeviceGetMaxClockInfo", gpu)
        return 1980

    def nvmlDeviceGetTemperature(self, gpu: FakeGpu, sensor: int) -> int:
        self._call("nvmlDeviceGetTemperature", gpu)
        return gpu.temperature_c

    def nvmlDeviceGetPowerUsage(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetPowerUsage", gpu)
        return 250_000  # milliwatts

    def nvmlDeviceGetCurrentClocksEventReasons(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetCurrentClocksEventReasons", gpu)
        return 0x1

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Any:
        self._call("nvmlDeviceGetMemoryInfo", gpu)
        return type("Memory", (), {"used": 2e9, "free": 139e9})()


@dataclass
class FakeDeviceProperties:
    """What `torch.cuda.get_device_properties` tells of a CUDA device."""

    uuid: str  # as torch prints its `_CUuuid`: no "GPU-" prefix
    pci_domain_id: int
    pci_bus_id: int
    pci_device_id: int


@dataclass
class FakeCuda:
    """torch.cuda as the engine sees it once its compute threads initialised CUDA."""

    nvml: FakeNvml
    devices: list[FakeDeviceProperties]  # by CUDA index (what CUDA_VISIBLE_DEVICES left)
    initialized: bool = True
    snapshots_on: list[str] = field(default_factory=list)  # thread names

    def memory_snapshot(self) -> list[dict[str, Any]]:
        self.snapshots_on.append(threading.current_thread().name)
        return [{"blocks": [{"state": "inactive", "size": 4096}]}]

    def get_device_properties(self, index: int | None = None) -> FakeDeviceProperties:
        assert self.initialized, "reading a device's properties initialised CUDA"
        return self.devices[index or 0]

    def reads_on(self, thread: str) -> int:
        """NVML calls and allocator snapshots made on `thread`."""
        nvml = sum(1 for _, name in self.nvml.calls if name == thread)
        return nvml + self.snapshots_on.count(thread)


def physical_gpu(n: int, **overrides: Any) -> FakeGpu:
    uuid = f"GPU-0000000{n}-7c78-7bcd-59f3-6eb718a047d3"
    return FakeGpu(uuid, f"00000000:{0x10 + n:02x}:00.0", **overrides)


def cuda_view(gpu: FakeGpu) -> FakeDeviceProperties:
    bus = int(gpu.pci_bus_id.split(":")[1], 16)
    return FakeDeviceProperties(gpu.uuid.removeprefix("GPU-"), 0, bus, 0)


@pytest.fixture
def fake_gpus(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCuda]:
    """Three GPUs; CUDA sees only the first (CUDA_VISIBLE_DEVICES=0) unless a test says."""
    nvml = FakeNvml([physical_gpu(0), physical_gpu(1), physical_gpu(2)])
    cuda = FakeCuda(nvml, [cuda_view(nvml.gpus[0])])
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: cuda.initialized)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {"num_alloc_retries": 2})
    monkeypatch.setattr(torch.cuda, "memory_snapshot", cuda.memory_snapshot)
    monkeypatch.setattr(torch.cuda, "get_device_properties", cuda.get_device_properties)
    yield cuda


async def test_nvml_and_the_allocator_snapshot_are_read_on_the_sampler_thread_not_the_loop(
    fake_gpus: FakeCuda,
) -> None:
    """Each 5 ms tick of the engine's loop read every probe there: NVML's driver calls and,
    once a second, the allocator's snapshot (a dict per block, under the GIL)."""
    clock = ManualClock(100.0)
    telemetry = ProcessTelemetry(
        "engine",
        Metrics(),
        [CudaAllocatorProbe(0, max_age_s=0.0), NvmlProbe(0)],
        gpu="0",
        clock=clock,
    )
    loop_thread = threading.current_thread().name
    telemetry.read()  # what each tick of the loop does
    assert fake_gpus.reads_on(loop_thread) == 0

    sampled = threading.Event()
    telemetry.sampler.on_round = sampled.set
    telemetry.start()
    try:
        assert sampled.wait(timeout=30)
    finally:
        await telemetry.stop()
    assert not telemetry.sampler.running  # the stop joined it

    clock.now += 1.0  # past the shared read
    readings = telemetry.read()
    assert readings["gpu_sm_clock_hertz"] == 1980e6
    assert readings["cuda_largest_free_block_bytes"] == 4096
    assert readings["cuda_alloc_retries_total"] == 2  # still read on the loop: cheap
    assert fake_gpus.reads_on(loop_thread) == 0
    assert fake_gpus.reads_on(SAMPLER_THREAD_NAME) > 0


def gauge(metrics: Metrics, name: str) -> float | None:
    return metrics.registry.get_sample_value(f"steadyserve_{name}", {"gpu": "0"})


def test_an_unsupported_field_is_left_out_alone_and_logged_once(
    fake_gpus: FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    """A GPU whose power NVML cannot read lost every GPU reading for the engine's life."""
    fake_gpus.nvml.gpus[0].unsupported.add("nvmlDeviceGetPowerUsage")
    probe = NvmlProbe(0)
    with caplog.at_level(logging.INFO, logger="app.telemetry.gpu"):
        first, second = probe.sample(), probe.sample()
    for readings in (first, second):
        assert "gpu_power_watts" not in readings
        assert readings["gpu_sm_clock_hertz"] == 1980e6
        assert readings["gpu_temperature_celsius"] == 40.0
        assert readings["gpu_memory_free_bytes"] == 139e9
    assert fake_gpus.nvml.calls_to("nvmlDeviceGetPowerUsage") == 1  # not asked again
    assert sum("power" in record.getMessage() for record in caplog.records) == 1


def test_a_one_off_error_costs_its_field_one_sample_not_the_gpu_gauges(
    fake_gpus: FakeCuda,
) -> None:
    """One failed NVML call turned NVML off for good: the GPU gauges went NaN and
    `SteadyserveGpuReadingsLost` paged "drain the node" three minutes later."""
    metrics = Metrics()
    probe = NvmlProbe(0)
    telemetry = ProcessTelemetry("engine", metrics, [probe], gpu="0")
    probe.publish(probe.sample())
    telemetry.publish()
    fake_gpus.nvml.gpus[0].errors["nvmlDeviceGetPowerUsage"] = [UNKNOWN]
    probe.publish(probe.sample())
    telemetry.publish()
    assert gauge(metrics, "gpu_sm_clock_hertz") == 1980e6  # what the alert watches
    assert gauge(metrics, "gpu_temperature_celsius") == 40.0
    power = gauge(metrics, "gpu_power_watts")
    assert power is not None and math.isnan(power)  # that field alone, this sample
    probe.sample()  # the retry waits one sample
    assert probe.sample()["gpu_power_watts"] == 250.0


def test_a_field_failing_again_and_again_is_retried_less_and_less_often(
    fake_gpus: FakeCuda, caplog: pytest.LogCaptureFixture
) -> None:
    fake_gpus.nvml.gpus[0].errors["nvmlDeviceGetTemperature"] = [UNKNOWN] * 4
    probe = NvmlProbe(0)
    tried_at = []
    with caplog.at_level(logging.WARNING, logger="app.telemetry.gpu"):
        for number in range(1, 25):
            before = fake_gpus.nvml.calls_to("nvmlDeviceGetTemperature")
            readings = probe.sample()
            if fake_gpus.nvml.calls_to("nvmlDeviceGetTemperature") > before:
                tried_at.append(number)
            assert readings["gpu_sm_clock_hertz"] == 1980e6
    # Fails at 1, 3, 6 and 11 (1, 2, 4 samples skipped after them), answers at 20.
    assert tried_at[:5] == [1, 3, 6, 11, 20]
    assert "gpu_temperature_celsius" in probe.sample()
    assert len(caplog.records) == 1  # one warning for the whole run of failures


def test_only_a_lost_gpu_ends_every_reading(fake_gpus: FakeCuda) -> None:
    probe = NvmlProbe(0)
    assert probe.sample()["gpu_sm_clock_hertz"] == 1980e6
    fake_gpus.nvml.gpus[0].errors["nvmlDeviceGetTemperature"] = [GPU_IS_LOST]
    assert probe.sample() == {}
    calls = len(fake_gpus.nvml.calls)
    assert probe.sample() == {} and not probe.available
    assert len(fake_gpus.nvml.calls) == calls  # a lost GPU is not asked again


def test_the_gpu_read_is_the_one_cuda_computes_on_not_nvml_index_0(fake_gpus: FakeCuda) -> None:
    """CUDA_VISIBLE_DEVICES=2: CUDA's device 0 is the machine's third GPU, but NVML ignores
    that variable, and the probe opened NVML's device 0 (another job's GPU)."""
    visible = fake_gpus.nvml.gpus[2]
    visible.temperature_c, visible.sm_clock_mhz = 83, 1410
    fake_gpus.devices = [cuda_view(visible)]
    readings = NvmlProbe(0).sample()
    assert readings["gpu_temperature_celsius"] == 83.0
    assert readings["gpu_sm_clock_hertz"] == 1410e6


def test_a_device_whose_uuid_nvml_does_not_know_is_found_by_its_pci_bus_id(
    fake_gpus: FakeCuda,
) -> None:
    """A MIG instance: CUDA's UUID is the instance's; its GPU's bus id finds the GPU."""
    gpu = fake_gpus.nvml.gpus[1]
    gpu.temperature_c = 61
    fake_gpus.devices = [replace(cuda_view(gpu), uuid="5d4b1a2c-0000-0000-0000-000000000000")]
    assert NvmlProbe(0).sample()["gpu_temperature_celsius"] == 61.0


def test_nvml_is_opened_only_once_cuda_is_initialised(fake_gpus: FakeCuda) -> None:
    """Torch tells the device's UUID only by initialising CUDA, which the compute threads
    do (on the sampler thread it would be a context of its own, before theirs)."""
    fake_gpus.initialized = False
    fake_gpus.devices = [cuda_view(fake_gpus.nvml.gpus[2])]
    probe = NvmlProbe(0)
    assert probe.sample() == {} and fake_gpus.nvml.calls == []
    fake_gpus.initialized = True
    fake_gpus.nvml.gpus[2].temperature_c = 70
    assert probe.sample()["gpu_temperature_celsius"] == 70.0


def test_a_device_nvml_cannot_find_reads_nothing_and_is_not_looked_up_again(
    fake_gpus: FakeCuda,
) -> None:
    fake_gpus.devices = [FakeDeviceProperties("0badc0de-0000-0000-0000-000000000000", 0, 0x99, 0)]
    probe = NvmlProbe(0)
    assert probe.sample() == {} and probe.sample() == {}
    assert fake_gpus.nvml.calls_to("nvmlDeviceGetHandleByUUID") == 1
    assert not probe.available
