"""The supervisor's run directory (`app/run_dir.py`): removed by the next supervisor to start
when its own was killed, never while its owner lives, and nothing else ever removed."""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.metrics import MULTIPROCESS_DIR_ENV
from app.processes import serve_processes
from app.run_dir import OWNER_LOCK, remove_stale_run_directories, run_directory
from app.settings import Settings


def left_behind(parent: Path, name: str, owner_pid: int) -> Path:
    """A run directory as a supervisor killed with SIGKILL leaves it: its sockets and metrics
    files, and its owner lock, which nobody holds any more."""
    run_dir = parent / name
    (run_dir / "metrics").mkdir(parents=True)
    (run_dir / "metrics" / "counter_12.db").write_bytes(b"\0" * 16)
    (run_dir / "engine-requests.sock").touch()
    (run_dir / OWNER_LOCK).write_text(f"{owner_pid}\n")
    return run_dir


@pytest.fixture
def live_owner(tmp_path: Path) -> Iterator[Path]:
    """A run directory whose owner lives: its lock is held (here by the test itself, through
    a descriptor of its own, as its supervisor holds it)."""
    run_dir = left_behind(tmp_path, "steadyserve-live", os.getpid())
    descriptor = os.open(run_dir / OWNER_LOCK, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX)
    yield run_dir
    os.close(descriptor)


def test_only_run_directories_of_dead_supervisors_are_removed(
    tmp_path: Path, live_owner: Path
) -> None:
    dead = left_behind(tmp_path, "steadyserve-dead", 999_999)
    # The supervisor is pid 1 of its container, and so is the one that replaces it: the pid
    # a dead one recorded may be alive. Its lock, released at its death, says it is dead.
    dead_pid_reused = left_behind(tmp_path, "steadyserve-reused", os.getpid())
    not_ours = [
        left_behind(tmp_path, "other-dir", 999_999),  # not named as ours
        tmp_path / "steadyserve-engine-abc",  # no owner lock: not of this layout
    ]
    not_ours[1].mkdir()
    (tmp_path / "steadyserve-file").write_text("not a directory")
    elsewhere = left_behind(tmp_path / "elsewhere", "target", 999_999)
    (tmp_path / "steadyserve-link").symlink_to(elsewhere)  # never followed

    removed = remove_stale_run_directories(tmp_path)

    assert removed == [dead, dead_pid_reused]
    assert not dead.exists() and not dead_pid_reused.exists()
    assert (live_owner / "metrics" / "counter_12.db").exists()
    assert all(path.exists() for path in not_ours)
    assert (tmp_path / "steadyserve-file").exists() and (elsewhere / OWNER_LOCK).exists()


def test_serve_removes_a_dead_supervisors_run_directory_at_start_up(
    tmp_path: Path, live_owner: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A supervisor killed with SIGKILL left its run directory in the temp directory (a pod's
    emptyDir) forever: one more at every container restart."""
    dead = left_behind(tmp_path, "steadyserve-dead", 1)
    seen: list[Path] = []

    class Tree:
        def __init__(self, settings: Settings, run_dir: Path, **options: object) -> None:
            seen.append(run_dir)

        async def run(self) -> int:
            return 0

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, "")  # serve sets it: restored after the test
    monkeypatch.setattr("app.processes.reserve_shared_port", lambda host, port: socket.socket())
    monkeypatch.setattr("app.processes.ProcessTree", Tree)
    assert serve_processes(Settings()) == 0
    assert not dead.exists()
    assert live_owner.exists()
    assert len(seen) == 1 and seen[0].parent == tmp_path and not seen[0].exists()


OWNER_SCRIPT = """
import sys
from pathlib import Path
from app.run_dir import run_directory
with run_directory(Path(sys.argv[1])) as run_dir:
    print(run_dir, flush=True)
    sys.stdin.read()
"""


def start_owner(parent: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process holding a run directory under `parent` until its stdin closes."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER_SCRIPT, str(parent)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert owner.stdout is not None
    return owner, Path(owner.stdout.readline().strip())


def test_a_killed_owners_lock_is_released_and_a_live_ones_held(tmp_path: Path) -> None:
    killed, killed_dir = start_owner(tmp_path)
    live, live_dir = start_owner(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(30)
        assert killed_dir.is_dir() and (killed_dir / OWNER_LOCK).read_text() == f"{killed.pid}\n"
        assert remove_stale_run_directories(tmp_path) == [killed_dir]
        assert live_dir.is_dir()
    finally:
        live.communicate("", timeout=30)  # stdin closed: it ends its block
    assert live.returncode == 0 and not live_dir.exists()  # removed its own


def test_a_run_directory_is_locked_while_its_block_runs(tmp_path: Path) -> None:
    with run_directory(tmp_path) as run_dir:
        assert remove_stale_run_directories(tmp_path) == []
        assert run_dir.is_dir() and (run_dir / OWNER_LOCK).read_text() == f"{os.getpid()}\n"
    assert list(tmp_path.iterdir()) == []
