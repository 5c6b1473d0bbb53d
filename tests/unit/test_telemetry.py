"""The probes, each with injected values: counters and levels, cgroup v1/v2 files, /proc
files, the loop-lag split, GC pauses, caching, first-seen shapes, and the GPU and CUDA
probes degrading to nothing without a GPU or driver (this machine has none)."""

from __future__ import annotations

import asyncio
import gc
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from app.metrics import Metrics
from app.telemetry.cpu import CpuProbe, host_busy_cpu_seconds
from app.telemetry.cuda import CudaAllocatorProbe, CudaContextProbe, _largest_free_block
from app.telemetry.gc_pauses import GcPauseProbe
from app.telemetry.gpu import NvmlProbe, throttle_reason_names
from app.telemetry.loop_lag import LoopLagMonitor
from app.telemetry.probe import Cached, FakeProbe, ProbeSet, changes
from app.telemetry.procfile import ProcFile
from app.telemetry.sampler import READ_SHARED_S, ProcessTelemetry
from app.telemetry.schedstat import thread_runqueue_wait_s
from app.telemetry.shapes import ShapeTracker
from app.telemetry.throttling import read_throttling


def test_changes_keep_counter_increases_and_end_levels() -> None:
    start = {"a_total": 1.0, "b_total": 5.0, "clock": 1.0}
    end = {"a_total": 4.0, "b_total": 5.0, "clock": 0.5, "new_total": 2.0}
    assert changes(start, end) == {"a_total": 3.0, "clock": 0.5}


def test_cached_reader_rereads_only_after_max_age() -> None:
    now = [0.0]
    calls: list[float] = []

    def reader() -> dict[str, float]:
        calls.append(now[0])
        return {"x_total": float(len(calls))}

    cached = Cached(reader, max_age_s=0.005, clock=lambda: now[0])
    assert cached.read() == {"x_total": 1.0}
    now[0] = 0.004
    assert cached.read() == {"x_total": 1.0}
    now[0] = 0.006
    assert cached.read() == {"x_total": 2.0}


def test_cgroup_v2_throttling(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text(
        "usage_usec 100\nnr_periods 50\nnr_throttled 7\nthrottled_usec 42000\n"
    )
    assert read_throttling(tmp_path) == {
        "cgroup_periods_total": 50,
        "cgroup_throttled_periods_total": 7,
        "cgroup_throttled_seconds_total": 0.042,
    }


def test_cgroup_throttling_carries_the_quota_that_makes_it_wall_time(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("nr_periods 50\nnr_throttled 7\nthrottled_usec 80000\n")
    (tmp_path / "cpu.max").write_text("350000 100000\n")
    assert read_throttling(tmp_path)["cgroup_quota_cpus"] == 3.5


def test_cgroup_v1_throttling(tmp_path: Path) -> None:
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "cpu,cpuacct" / "cpu.stat").write_text(
        "nr_periods 9\nnr_throttled 3\nthrottled_time 80000000\n"
    )
    readings = read_throttling(tmp_path)
    assert readings["cgroup_throttled_periods_total"] == 3
    assert readings["cgroup_throttled_seconds_total"] == 0.08


def test_no_cgroup_files_read_nothing(tmp_path: Path) -> None:
    assert read_throttling(tmp_path) == {}


def test_host_busy_cpu_leaves_out_idle_and_iowait(tmp_path: Path) -> None:
    # user nice system idle iowait irq softirq steal, in clock ticks (100 per second)
    (tmp_path / "stat").write_text("cpu  100 0 50 900 30 0 10 0 0 0\ncpu0 1 2 3\n")
    assert host_busy_cpu_seconds(tmp_path) == 1.6


def test_cpu_probe_reads_this_process() -> None:
    readings = CpuProbe().read()
    assert readings["process_cpu_seconds_total"] > 0
    assert readings["process_resident_bytes"] > 1_000_000


def test_loop_lag_splits_blocked_from_starved() -> None:
    monitor = LoopLagMonitor(tick_s=0.01, clock=lambda: 0.0, thread_wait=lambda: 0.0)
    # Woke 310 ms after a 10 ms sleep, of which it waited 100 ms for a CPU.
    monitor.record(started=0.0, woke=0.31, runqueue_wait_s=0.1)
    readings = monitor.read()
    assert round(readings["loop_lag_seconds_total"], 6) == 0.3
    assert round(readings["loop_busy_lag_seconds_total"], 6) == 0.2
    assert round(monitor.take_high_water(), 6) == 0.3
    assert monitor.take_high_water() == 0.0


def test_loop_lag_counts_an_overdue_tick_before_it_runs() -> None:
    now = [0.0]
    monitor = LoopLagMonitor(tick_s=0.01, clock=lambda: now[0], thread_wait=lambda: 0.0)
    monitor._due_at = 0.01  # a tick is sleeping, due at 10 ms
    now[0] = 0.26  # ... and the loop was held until 260 ms
    assert round(monitor.read()["loop_lag_seconds_total"], 6) == 0.25


def test_gc_probe_times_real_collections_by_generation() -> None:
    probe = GcPauseProbe()
    probe.install()
    try:
        gc.collect(2)
    finally:
        probe.uninstall()
    readings = probe.read()
    assert readings["gc_gen2_collections_total"] >= 1
    assert readings["gc_gen2_pause_seconds_total"] > 0
    assert probe._callback not in gc.callbacks


def test_shape_tracker_flags_only_unwarmed_shapes_once() -> None:
    shapes = ShapeTracker()
    shapes.mark_warm((4, 16))
    assert not shapes.first_seen((4, 16))
    assert shapes.first_seen((8, 16))
    assert not shapes.first_seen((8, 16))


def test_gpu_and_cuda_probes_read_nothing_without_a_gpu() -> None:
    nvml = NvmlProbe(0)  # no driver on this machine: must not raise
    assert not nvml.available and nvml.read() == {}
    assert NvmlProbe(None).read() == {}
    assert CudaAllocatorProbe(None).read() == {}
    context = CudaContextProbe(enabled=False)
    context.check_thread()
    assert context.read() == {}


def test_largest_free_block_from_an_allocator_snapshot() -> None:
    snapshot = [
        {"blocks": [{"state": "active_allocated", "size": 10}, {"state": "inactive", "size": 4}]},
        {"blocks": [{"state": "inactive", "size": 7}]},
    ]
    assert _largest_free_block(snapshot) == 7.0


def test_throttle_reason_names() -> None:
    assert throttle_reason_names(0x1 | 0x40) == ["idle", "hardware thermal"]


def test_publishing_feeds_the_metrics_by_increase() -> None:
    metrics = Metrics()
    device = FakeProbe({"cuda_alloc_retries_total": 2.0, "gpu_sm_clock_hertz": 1.4e9})
    telemetry = ProcessTelemetry("engine", metrics, [device], gpu="0")
    telemetry.start()  # counters count from here
    device.add(cuda_alloc_retries_total=3)
    device.set(gpu_sm_clock_hertz=810e6)
    telemetry.publish()
    telemetry.publish()  # nothing new: nothing added
    registry = metrics.registry
    assert registry.get_sample_value("steadyserve_cuda_alloc_retries_total") == 3
    assert registry.get_sample_value("steadyserve_gpu_sm_clock_hertz", {"gpu": "0"}) == 810e6


def test_a_counter_missing_from_one_reading_does_not_count_its_history_again() -> None:
    metrics = Metrics()
    device = FakeProbe({"cuda_alloc_retries_total": 5.0})
    telemetry = ProcessTelemetry("engine", metrics, [device], gpu="0")
    telemetry.start()  # counts from 5
    del device.readings["cuda_alloc_retries_total"]  # unreadable for one publish
    telemetry.publish()
    device.set(cuda_alloc_retries_total=6.0)
    telemetry.publish()
    assert metrics.registry.get_sample_value("steadyserve_cuda_alloc_retries_total") == 1


def test_a_gpu_reading_that_stops_turns_its_gauges_to_nan_not_the_last_value() -> None:
    """NVML failing (a GPU lost off the bus) ends the GPU readings: the gauges kept the last
    healthy clock and temperature as current, so a dashboard showed a healthy GPU and a
    heat alert could keep firing on a value that no longer meant anything."""
    metrics = Metrics()
    device = FakeProbe({"gpu_sm_clock_hertz": 1.4e9, "gpu_temperature_celsius": 70.0})
    telemetry = ProcessTelemetry("engine", metrics, [device], gpu="0")
    telemetry.start()
    telemetry.publish()
    device.readings.clear()  # what NvmlProbe reads once NVML has failed
    telemetry.publish()
    for name in ("steadyserve_gpu_sm_clock_hertz", "steadyserve_gpu_temperature_celsius"):
        value = metrics.registry.get_sample_value(name, {"gpu": "0"})
        assert value is not None and math.isnan(value), name


def test_no_gpu_gauge_exists_until_the_engine_reads_its_gpu() -> None:
    """Every process builds `Metrics()`; an unlabelled gauge was 0 in each (front ends, a
    CPU engine), and the multiprocess minimum of those zeros and the engine's real clock
    was 0: "SM clock under 1 GHz" on every serving replica."""
    metrics = Metrics()
    ProcessTelemetry("frontend", metrics, [FakeProbe({"gpu_sm_clock_hertz": 1.9e9})]).publish()
    device_gauges = {
        sample.name
        for family in metrics.registry.collect()
        for sample in family.samples
        if sample.name.startswith(("steadyserve_gpu_", "steadyserve_cuda_allocator_"))
    }
    assert device_gauges == set()


def test_probe_set_merges_readings() -> None:
    probes = ProbeSet([FakeProbe({"a_total": 1}), FakeProbe({"b": 2})])
    assert probes.read() == {"a_total": 1, "b": 2}


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").exists(), reason="no schedstat here")
def test_runqueue_wait_is_the_calling_threads_own() -> None:
    def direct(thread_id: int) -> float:
        fields = Path(f"/proc/self/task/{thread_id}/schedstat").read_text().split()
        return int(fields[1]) / 1e9

    thread_runqueue_wait_s()  # this thread's file is open now: another must not reuse it
    bracket: list[float] = []

    def read_in_new_thread() -> None:
        me = threading.get_native_id()
        bracket.extend([direct(me), thread_runqueue_wait_s(), direct(me)])

    worker = threading.Thread(target=read_in_new_thread)
    worker.start()
    worker.join()
    before, ours, after = bracket
    assert before <= ours <= after


def test_a_periodic_tasks_sleep_ticks_the_monitor_when_telemetry_has_no_ticker() -> None:
    times = iter([0.0, 0.055])  # asked to sleep 5 ms, woke 55 ms later
    waits = iter([1.0, 1.02])  # of which 20 ms runnable off a CPU
    monitor = LoopLagMonitor(clock=lambda: next(times), thread_wait=lambda: next(waits))
    telemetry = ProcessTelemetry("engine", Metrics(), loop=monitor, own_ticker=False)

    async def one_beat() -> None:
        telemetry.start()
        assert monitor._task is None  # no ticker of its own: no extra wake-ups
        await telemetry.sleep(0.005)
        await telemetry.stop()

    asyncio.run(one_beat())
    readings = monitor.read()
    assert round(readings["loop_lag_seconds_total"], 6) == 0.05
    assert round(readings["loop_busy_lag_seconds_total"], 6) == 0.03


def test_a_proc_file_is_reread_through_its_open_descriptor(tmp_path: Path) -> None:
    path = tmp_path / "cpu.stat"
    path.write_text("nr_periods 1\n")
    file = ProcFile(path)
    assert file.text() == "nr_periods 1\n"
    with path.open("r+") as same_inode:  # rewritten in place, as the kernel's files are
        same_inode.write("nr_periods 2\n")
    assert file.text() == "nr_periods 2\n"
    file.close()
    assert ProcFile(tmp_path / "absent").text() is None


class CountingProbe(FakeProbe):
    def __init__(self, values: dict[str, float]) -> None:
        super().__init__(values)
        self.reads = 0

    def read(self) -> dict[str, float]:
        self.reads += 1
        return dict(super().read())


def test_reads_within_a_millisecond_share_one_reading_of_the_probes() -> None:
    now = [10.0]
    probe = CountingProbe({"a_total": 1.0})
    telemetry = ProcessTelemetry("frontend", Metrics(), [probe], clock=lambda: now[0])
    first = telemetry.read()
    probe.add(a_total=1)
    now[0] += READ_SHARED_S / 2  # the same loop turn: shared
    assert telemetry.read() == first == {"a_total": 1.0}
    now[0] += READ_SHARED_S  # later: read again
    assert telemetry.read() == {"a_total": 2.0}
    assert probe.reads == 2


def test_throttling_is_read_where_the_quota_is_not_at_the_root(tmp_path: Path) -> None:
    """A systemd unit's CPUQuota= (or `--cgroupns=host`): the quota below the root was
    found, but throttling was read from the root's cpu.stat, which is never throttled."""
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self"
    unit = root / "system.slice" / "steadyserve.service"
    unit.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cpu.stat").write_text("nr_periods 0\nnr_throttled 0\nthrottled_usec 0\n")
    (unit / "cpu.max").write_text("200000 100000\n")
    (unit / "cpu.stat").write_text("nr_periods 90\nnr_throttled 12\nthrottled_usec 30000\n")
    self_cgroup.write_text("0::/system.slice/steadyserve.service\n")
    readings = read_throttling(root, self_cgroup)
    assert readings["cgroup_throttled_periods_total"] == 12
    assert readings["cgroup_throttled_seconds_total"] == 0.03
    assert readings["cgroup_quota_cpus"] == 2.0


def test_a_probe_file_out_of_descriptors_is_read_again_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # EMFILE in a connection flood was taken for "no such file": never read again.
    import errno
    import os

    path = tmp_path / "stat"
    path.write_text("42")
    probe = ProcFile(str(path), 64)
    real_open = os.open

    def out_of_descriptors(*args: object, **kwargs: object) -> int:
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(os, "open", out_of_descriptors)
    assert probe.text() is None
    monkeypatch.setattr(os, "open", real_open)
    assert probe.text() == "42"
    probe.close()
    assert ProcFile(str(tmp_path / "absent"), 64).text() is None


def test_a_schedstat_open_that_fails_leaves_no_error_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import os
    import sys

    from app.telemetry import schedstat

    def out_of_descriptors(*args: object, **kwargs: object) -> int:
        raise OSError(24, "Too many open files")

    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    monkeypatch.setattr(os, "open", out_of_descriptors)

    # A fresh thread has no schedstat file open yet, so the call must open one (and fail).
    # The result comes back to this thread: an assertion inside a plain Thread would only
    # be a warning and could not fail the test.
    with ThreadPoolExecutor(max_workers=1) as fresh_thread:
        wait_s = fresh_thread.submit(schedstat.thread_runqueue_wait_s).result()
    assert wait_s == 0.0
    gc.collect()
    assert unraisable == []
