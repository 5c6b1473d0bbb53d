"""cgroup throttling as wall time: the kernel's throttled total is summed over the group's
per-CPU runqueues, as many as the CPUs its threads ran on (not the quota's), so attribution
divides it by the CPUs the process may run on and caps it at the throttled periods times
the period; the probe reads both (app/telemetry/throttling.py)."""

from __future__ import annotations

import os
from pathlib import Path

from app.engine.protocol import BatchTrace, EngineTrace
from app.spikes.attribution import RequestFacts, attribute
from app.telemetry.throttling import read_throttling


def throttled_request(throttling: dict[str, float]) -> RequestFacts:
    """300 ms: a 250 ms batch estimated at 200, in an engine whose cgroup was throttled."""
    batch = BatchTrace(1, 1, 64, [40], 0.0, 0.0, 0.25, 0.0, 0.2, 0.0, False)
    return RequestFacts(
        total_s=0.3,
        phases={"queue": 0.001, "compute": 0.25},
        frontend_pid=100,
        engine=EngineTrace(200, 0, batch, throttling),
    )


def throttled_ms(request: RequestFacts) -> float:
    causes = {cause.name: cause for cause in attribute(request)}
    return round(causes["cgroup_throttled"].seconds * 1000, 1)


def test_throttling_summed_over_more_cpus_than_the_quota_is_not_overstated() -> None:
    """A 2-CPU quota whose threads ran on 9 CPUs, throttled 50 ms in one period: the kernel
    counts 450 ms, reported as 225 ms (over the quota's 2 CPUs), ranked first."""
    throttling = {
        "cgroup_throttled_seconds_total": 0.45,
        "cgroup_throttled_periods_total": 1,
        "cgroup_quota_cpus": 2.0,
        "allowed_cpus": 16,
        "cgroup_period_seconds": 0.1,
    }
    request = throttled_request(throttling)
    assert 0 < throttled_ms(request) <= 50
    cause = next(cause for cause in attribute(request) if cause.name == "cgroup_throttled")
    assert "(450 ms of CPU time over 16 CPUs) in 1 CFS periods" in cause.evidence


def test_throttling_is_at_most_its_periods_without_the_cpus_it_ran_on() -> None:
    # Probes without the affinity reading: over the quota's CPUs, but never past one
    # 100 ms period for each throttled period.
    throttling = {
        "cgroup_throttled_seconds_total": 0.45,
        "cgroup_throttled_periods_total": 1,
        "cgroup_quota_cpus": 2.0,
        "cgroup_period_seconds": 0.1,
    }
    assert throttled_ms(throttled_request(throttling)) == 100


def at_the_root(tmp_path: Path) -> Path:
    """A /proc/self/cgroup naming the root of both hierarchies (a container's own view)."""
    self_cgroup = tmp_path / "self"
    self_cgroup.write_text("0::/\n4:cpu,cpuacct:/\n")
    return self_cgroup


def test_the_probe_reads_the_period_and_the_cpus_it_may_run_on(tmp_path: Path) -> None:
    (tmp_path / "cpu.stat").write_text("nr_periods 50\nnr_throttled 7\nthrottled_usec 80000\n")
    (tmp_path / "cpu.max").write_text("200000 50000\n")
    readings = read_throttling(tmp_path, at_the_root(tmp_path))
    assert readings["cgroup_quota_cpus"] == 4.0
    assert readings["cgroup_period_seconds"] == 0.05
    assert readings["allowed_cpus"] == len(os.sched_getaffinity(0))


def test_the_probe_reads_a_v1_period(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu,cpuacct"
    v1.mkdir()
    (v1 / "cpu.stat").write_text("nr_periods 9\nnr_throttled 3\nthrottled_time 80000000\n")
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    readings = read_throttling(tmp_path, at_the_root(tmp_path))
    assert readings["cgroup_quota_cpus"] == 1.5
    assert readings["cgroup_period_seconds"] == 0.1
