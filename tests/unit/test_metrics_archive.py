"""Dead processes' metric files folded into archives (app/metrics_archive.py): every
counter and histogram reads the same on /metrics before and after, the files are gone, and
a scrape never runs while a fold does."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.parser import text_string_to_metric_families

from app import metrics_archive
from app.metrics import MULTIPROCESS_DIR_ENV, Metrics
from app.metrics_archive import compact_dead_process

HELP = "demo"


def write(path: Path, values: dict[str, float]) -> None:
    written = MmapedDict(str(path))
    for key, value in values.items():
        written.write_value(key, value, 0.0)
    written.close()


def counter(labels: dict[str, str]) -> str:
    names = sorted(labels)
    return mmap_key(
        "steadyserve_demo", "steadyserve_demo_total", names, [labels[n] for n in names], HELP
    )


def bucket(le: str) -> str:
    return mmap_key("steadyserve_lat", "steadyserve_lat_bucket", ["le", "model"], [le, "m"], HELP)


def histogram(count_in_first: float, count_in_second: float, total: float) -> dict[str, float]:
    return {
        bucket("0.1"): count_in_first,
        bucket("1.0"): count_in_second,
        bucket("+Inf"): 0.0,
        mmap_key("steadyserve_lat", "steadyserve_lat_sum", ["model"], ["m"], HELP): total,
    }


def gauge(value: float) -> dict[str, float]:
    return {mmap_key("steadyserve_busy", "steadyserve_busy", [], [], HELP): value}


def samples(directory: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    rendered = Metrics().render().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(rendered)
        for sample in family.samples
    }


@pytest.fixture
def directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(tmp_path))
    for pid, scale in ((101, 1.0), (102, 10.0), (103, 100.0)):
        write(tmp_path / f"counter_{pid}.db", {
            counter({"reason": "rate"}): 1 * scale, counter({"reason": "queue"}): 2 * scale,
        })  # fmt: skip
        write(tmp_path / f"histogram_{pid}.db", histogram(3 * scale, 4 * scale, 5 * scale))
        write(tmp_path / f"gauge_livesum_{pid}.db", gauge(scale))
    write(tmp_path / "counter_104.db", {counter({"reason": "draining"}): 7.0})  # dies alone
    return tmp_path


def test_folding_dead_processes_keeps_every_counter_and_histogram_value(
    directory: Path,
) -> None:
    before = samples(directory)
    for dead in (101, 103, 104):
        compact_dead_process(str(directory), dead)
    after = samples(directory)

    def counted(values: dict[Any, float]) -> dict[Any, float]:
        return {key: value for key, value in values.items() if key[0] != "steadyserve_busy"}

    assert counted(after) == counted(before)
    assert after[("steadyserve_demo_total", (("reason", "rate"),))] == 111.0
    assert after[("steadyserve_lat_count", (("model", "m"),))] == 777.0
    assert after[("steadyserve_demo_total", (("reason", "draining"),))] == 7.0
    assert after[("steadyserve_busy", ())] == 10.0  # the dead processes' gauges dropped
    assert sorted(os.listdir(directory)) == [
        ".compaction.lock", "counter_102.db", "counter_archive.db",
        "gauge_livesum_102.db", "histogram_102.db", "histogram_archive.db",
    ]  # fmt: skip


def test_an_empty_file_of_a_dead_process_is_deleted(directory: Path) -> None:
    """A process killed between creating its file and sizing it left an empty one."""
    (directory / "counter_105.db").touch()
    compact_dead_process(str(directory), 105)
    assert not (directory / "counter_105.db").exists()
    assert samples(directory)[("steadyserve_demo_total", (("reason", "rate"),))] == 111.0


def held_exclusively_elsewhere(directory: Path) -> bool:
    fd = os.open(directory / ".compaction.lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_scrape_reads_the_files_under_the_lock_folds_wait_for(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from prometheus_client.multiprocess import MultiProcessCollector

    merge: Callable[..., Any] = MultiProcessCollector.merge
    locked: list[bool] = []

    def checked_merge(files: list[str], accumulate: bool = True) -> Any:
        locked.append(held_exclusively_elsewhere(directory))
        return merge(files, accumulate)

    monkeypatch.setattr("app.metrics_render.MultiProcessCollector.merge", checked_merge)
    samples(directory)
    assert locked == [True]


def test_a_fold_replaces_and_deletes_under_the_lock(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    replace, remove = os.replace, os.remove
    locked: list[bool] = []

    def checked_replace(source: str, target: str) -> None:
        locked.append(held_exclusively_elsewhere(directory))
        replace(source, target)

    def checked_remove(path: str) -> None:
        locked.append(held_exclusively_elsewhere(directory))
        remove(path)

    monkeypatch.setattr(metrics_archive.os, "replace", checked_replace)
    monkeypatch.setattr(metrics_archive.os, "remove", checked_remove)
    compact_dead_process(str(directory), 101)
    assert locked and all(locked)


def test_the_archive_is_allocated_before_it_is_written_and_never_grown(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """prometheus_client's writer grows a new file sparsely (truncate) and writes it through
    mmap: on a full disk a write to a page with no block behind it is SIGBUS, which killed
    the supervisor. The archive's bytes are allocated first, enough for every value (here
    over the library's first 64 KiB), so the library never grows it."""
    many = {counter({"reason": f"r{index:05d}"}): float(index) for index in range(3000)}
    write(directory / "counter_105.db", many)
    allocate = os.posix_fallocate
    reserved: list[int] = []

    def recorded(fd: int, offset: int, length: int) -> None:
        reserved.append(offset + length)
        allocate(fd, offset, length)

    monkeypatch.setattr(metrics_archive.os, "posix_fallocate", recorded)
    compact_dead_process(str(directory), 105)
    archive = (directory / "counter_archive.db").stat()
    assert reserved and reserved[-1] == archive.st_size > 1 << 16
    assert archive.st_blocks * 512 >= archive.st_size  # not sparse
    after = samples(directory)
    assert after[("steadyserve_demo_total", (("reason", "r02999"),))] == 2999.0
    assert after[("steadyserve_demo_total", (("reason", "rate"),))] == 111.0


def no_space(fd: int, offset: int, length: int) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_fails_the_fold_with_an_os_error_and_loses_nothing(
    directory: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file system this test cannot fill: ENOSPC from the allocation. The archive and the
    dead process's files stay as they were (its counters still counted), no half-written
    file is left, and its gauges are dropped all the same."""
    compact_dead_process(str(directory), 103)  # an archive to keep
    before = samples(directory)
    archived = (directory / "counter_archive.db").read_bytes()
    monkeypatch.setattr(metrics_archive.os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match="No space left"):
        compact_dead_process(str(directory), 101)
    assert (directory / "counter_archive.db").read_bytes() == archived
    assert (directory / "counter_101.db").exists()
    assert not list(directory.glob("*.tmp"))
    assert not (directory / "gauge_livesum_101.db").exists()
    after = samples(directory)
    assert after.pop(("steadyserve_busy", ())) == 10.0  # 101's gauge gone, 102's left
    assert after == {k: v for k, v in before.items() if k[0] != "steadyserve_busy"}


@pytest.mark.parametrize(
    "failure",
    [
        OSError(errno.ENOSPC, "full"),
        RuntimeError("Read beyond file size detected, file is corrupted."),
    ],
)
def test_a_failed_fold_drops_the_dead_process_gauges_all_the_same(
    directory: Path, monkeypatch: pytest.MonkeyPatch, failure: Exception
) -> None:
    """Its in-flight and queue-depth gauges stayed on /metrics after the fold failed."""

    def fails(directory: str, metric_type: str, dead: str) -> None:
        raise failure

    monkeypatch.setattr(metrics_archive, "_fold", fails)
    with pytest.raises(type(failure)):
        compact_dead_process(str(directory), 101)
    assert not (directory / "gauge_livesum_101.db").exists()
    assert samples(directory)[("steadyserve_busy", ())] == 110.0


async def test_a_failed_fold_is_logged_with_its_traceback_and_never_raised(
    directory: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Only an OSError was caught: the library's 'file is corrupted' RuntimeError ended the
    supervisor's task that awaited the fold."""

    def corrupted(directory: str, pid: int) -> None:
        raise RuntimeError("Read beyond file size detected, file is corrupted.")

    monkeypatch.setattr(metrics_archive, "compact_dead_process", corrupted)
    with caplog.at_level(logging.ERROR, logger="app.metrics_archive"):
        await metrics_archive.forget_dead_process(101)
    [record] = caplog.records
    assert record.getMessage() == "could not fold the metrics of dead process 101"
    assert record.exc_info is not None and "corrupted" in str(record.exc_info[1])
