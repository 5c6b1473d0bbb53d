"""Thread sizing from the cgroup CPU quota, read from fake cgroup trees."""

from __future__ import annotations

from pathlib import Path

from app.dispatcher import default_thread_plan, engine_thread_plan, plan_threads
from app.settings import Settings
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


def test_the_quota_on_the_process_own_cgroup_counts_not_only_the_root(tmp_path: Path) -> None:
    """A systemd unit's CPUQuota= (or a container sharing the host's cgroup namespace) is
    set below the root: reading the root alone sized torch to every host core."""
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self"
    unit = root / "system.slice" / "steadyserve.service"
    unit.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    (root / "cpu.max").write_text("max 100000\n")
    (unit / "cpu.max").write_text("200000 100000\n")
    self_cgroup.write_text("0::/system.slice/steadyserve.service\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 2.0
    (root / "system.slice" / "cpu.max").write_text("150000 100000\n")  # a tighter parent
    assert cgroup_cpu_quota(root, self_cgroup) == 1.5


def test_the_v1_quota_on_the_process_own_cgroup(tmp_path: Path) -> None:
    root, self_cgroup = tmp_path / "cgroup", tmp_path / "self"
    own = root / "cpu,cpuacct" / "docker" / "abc"
    own.mkdir(parents=True)
    (own / "cpu.cfs_quota_us").write_text("300000\n")
    (own / "cpu.cfs_period_us").write_text("100000\n")
    self_cgroup.write_text("4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    assert cgroup_cpu_quota(root, self_cgroup) == 3.0


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


def test_the_engine_leaves_one_cpu_to_each_front_end() -> None:
    # 2 CPUs: one front end, so one compute thread with one torch thread (2 x 1 would
    # oversubscribe the CPUs the front end answers on, and take half-empty batches).
    two = engine_thread_plan(Settings(), cpus=2)
    assert (two.compute_threads, two.torch_intra_op) == (1, 1)
    # 16 CPUs: 8 front ends leave 8, shared by 2 compute threads.
    sixteen = engine_thread_plan(Settings(), cpus=16)
    assert (sixteen.compute_threads, sixteen.torch_intra_op) == (2, 4)
    # Front ends counted as configured, the in-process front end as one.
    one_frontend = engine_thread_plan(Settings(frontend_workers=1), cpus=8)
    assert (one_frontend.compute_threads, one_frontend.torch_intra_op) == (2, 3)
    inprocess = engine_thread_plan(Settings(engine="inprocess", frontend_workers=4), cpus=4)
    assert (inprocess.compute_threads, inprocess.torch_intra_op) == (2, 1)
    # Never fewer than one CPU, and explicit settings win.
    single = engine_thread_plan(Settings(), cpus=1)
    assert (single.compute_threads, single.torch_intra_op) == (1, 1)
    explicit = engine_thread_plan(Settings(dispatcher_threads=2, torch_threads=3), cpus=2)
    assert (explicit.compute_threads, explicit.torch_intra_op) == (2, 3)
    assert default_thread_plan(16) == sixteen
