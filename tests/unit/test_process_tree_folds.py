"""The supervisor folds a dead child's metric files (app/metrics_archive.py) and goes on
restarting it whatever the fold does: a full disk (ENOSPC, simulated: a file system these
tests cannot fill) or a file the library finds corrupted is logged with its traceback, and
neither a front end's restart loop nor the engine's fold task ends with the error. Stand-in
processes: no child is started."""

from __future__ import annotations

import asyncio
import errno
import logging
import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from app import metrics_archive
from app.metrics_archive import MULTIPROCESS_DIR_ENV
from app.processes import ProcessTree
from app.settings import Settings
from tests.support.process_tree import StandIn

FAILED = "could not fold the metrics of dead process"


def write(path: Path, key: str, value: float) -> None:
    written = MmapedDict(str(path))
    written.write_value(key, value, 0.0)
    written.close()


@pytest.fixture
def metrics_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The multiprocess directory, with the files of the dead front end (10) and engine (20):
    a counter and a live gauge each."""
    directory = tmp_path / "metrics"
    directory.mkdir()
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(directory))
    for pid in (10, 20):
        write(directory / f"counter_{pid}.db", mmap_key("c", "c_total", [], [], "c"), 1.0)
        write(directory / f"gauge_livesum_{pid}.db", mmap_key("g", "g", [], [], "g"), 1.0)
    return directory


def no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def corrupted(directory: str, pid: int) -> None:
    raise RuntimeError("Read beyond file size detected, file is corrupted.")


def failed_folds(caplog: pytest.LogCaptureFixture, pid: int) -> list[logging.LogRecord]:
    return [
        record
        for record in caplog.records
        if record.getMessage() == f"{FAILED} {pid}" and record.exc_info is not None
    ]


async def keep_restarting(tree: ProcessTree, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Run front end 0's restart loop over front ends that die at once, until the third
    restart stops the server; the pids of those restarted."""
    spawned: list[int] = []

    def spawn(index: int) -> None:
        spawned.append(11 + len(spawned))
        if len(spawned) == 3:
            tree._stopping = True
        tree.frontends[index] = StandIn(spawned[-1])  # type: ignore[call-overload]
        tree._frontends_serving_since[index] = None

    async def exited(process: StandIn) -> None:
        return None

    monkeypatch.setattr(tree, "_spawn_frontend", spawn)
    monkeypatch.setattr(tree, "_tell_engine_frontend_gone", lambda pid: None)
    monkeypatch.setattr("app.processes.wait_for_exit", exited)
    await asyncio.wait_for(tree._keep_frontend(0), timeout=10)
    return spawned


@pytest.fixture
async def tree(tmp_path: Path) -> AsyncIterator[ProcessTree]:
    tree = ProcessTree(Settings(engine_restart_backoff_s=(0.001, 0.004)), tmp_path)
    tree.frontends = [StandIn(10)]  # type: ignore[list-item]
    tree._frontends_serving_since = [None]
    yield tree
    tree._zmq.destroy(linger=0)


async def test_a_full_disk_skips_the_fold_and_the_front_end_is_restarted(
    tree: ProcessTree,
    metrics_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The archive is allocated before the library maps it: a full disk is an OSError the
    supervisor logs (it was SIGBUS inside the library's mmap writes, which killed the
    supervisor and every child). The dead front end's counter stays, still counted; its
    gauge is dropped."""
    monkeypatch.setattr(metrics_archive.os, "posix_fallocate", no_space)
    with caplog.at_level(logging.ERROR):
        spawned = await keep_restarting(tree, monkeypatch)
    assert spawned == [11, 12, 13]
    assert len(failed_folds(caplog, 10)) == 1
    assert (metrics_dir / "counter_10.db").exists()
    assert not (metrics_dir / "gauge_livesum_10.db").exists()
    assert not [name for name in os.listdir(metrics_dir) if name.endswith(".tmp")]


async def test_a_front_end_whose_fold_fails_is_restarted_and_the_failure_logged(
    tree: ProcessTree,
    metrics_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The library's 'file is corrupted' RuntimeError ended the front end's restart loop:
    its slot was never restarted, and the error was swallowed unlogged at the stop."""
    monkeypatch.setattr(metrics_archive, "compact_dead_process", corrupted)
    with caplog.at_level(logging.ERROR):
        spawned = await keep_restarting(tree, monkeypatch)
    assert spawned == [11, 12, 13]
    assert [len(failed_folds(caplog, pid)) for pid in (10, 11, 12)] == [1, 1, 1]


def full_disk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_archive.os, "posix_fallocate", no_space)


def corrupted_file(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(metrics_archive, "compact_dead_process", corrupted)


@pytest.mark.parametrize("failure", [full_disk, corrupted_file])
async def test_an_engine_whose_fold_fails_has_the_failure_logged(
    tree: ProcessTree,
    metrics_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    failure: Callable[[pytest.MonkeyPatch], None],
) -> None:
    """The engine's fold task ended with a corrupted file's error, logged (if ever) only as
    an exception never retrieved; a full disk was SIGBUS in the supervisor."""
    failure(monkeypatch)
    with caplog.at_level(logging.ERROR):
        tree._engine_exited(20)
        [task] = tree._metric_folds
        await asyncio.wait([task], timeout=10)
    assert task.done() and task.exception() is None
    assert len(failed_folds(caplog, 20)) == 1
    assert (metrics_dir / "counter_20.db").exists()
