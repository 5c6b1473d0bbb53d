"""Thread sizing from the cgroup CPU quota, read from fake cgroup trees."""

from __future__ import annotations

from pathlib import Path

from app.dispatcher import plan_threads
from app.telemetry.cgroup import available_cpus, cgroup_cpu_quota


def test_cgroup_v2_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_quota(tmp_path) == 2.5
    assert available_cpus(tmp_path, affinity=8) == 3  # a part CPU counts as a whole one
    assert available_cpus(tmp_path, affinity=2) == 2  # bounded by the affinity too


def test_cgroup_v2_unlimited(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_cgroup_v1_quota_and_unlimited(tmp_path: Path) -> None:
    v1 = tmp_path / "cpu,cpuacct"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) == 0.5
    assert available_cpus(tmp_path, affinity=4) == 1
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(tmp_path) is None


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None
    assert available_cpus(tmp_path, affinity=6) == 6


def test_threads_default_to_the_quota_not_the_host() -> None:
    plan = plan_threads(
        compute_threads=None, torch_threads=None, torch_interop_threads=None, cpus=2
    )
    assert (plan.compute_threads, plan.torch_intra_op, plan.torch_inter_op) == (2, 1, 1)
    eight = plan_threads(None, None, None, cpus=8)
    assert (eight.compute_threads, eight.torch_intra_op) == (2, 4)
    single = plan_threads(None, None, None, cpus=1)
    assert (single.compute_threads, single.torch_intra_op) == (1, 1)
    explicit = plan_threads(1, torch_threads=3, torch_interop_threads=2, cpus=2)
    assert (explicit.compute_threads, explicit.torch_intra_op, explicit.torch_inter_op) == (1, 3, 2)
