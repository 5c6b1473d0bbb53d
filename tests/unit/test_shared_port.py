"""The shared port (`app/shared_port.py`): checked, then held by the supervisor for its front
ends, so nothing else takes it between the check and their listening."""

from __future__ import annotations

import errno
import socket
import tempfile
from pathlib import Path

import pytest

from app.metrics import MULTIPROCESS_DIR_ENV
from app.processes import serve_processes
from app.settings import Settings
from app.shared_port import PortUnavailable, reserve_shared_port, shared_port_socket

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind((HOST, 0))
        port: int = probe.getsockname()[1]
        return port


def test_serve_holds_its_port_from_the_check_until_it_exits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The port was checked, then left free until a front end listened (after its whole
    start-up): a server that bound it meanwhile made every front end's listen fail, with a
    traceback, restarted forever (exit 1 once stopped)."""
    port = free_port()
    outcomes: list[object] = []

    class Tree:
        def __init__(self, settings: Settings, run_dir: Path, **options: object) -> None:
            pass

        async def run(self) -> int:
            # Another server, after the check, while no front end listens yet.
            try:
                with socket.create_server((HOST, port)):  # SO_REUSEADDR, as servers set
                    outcomes.append("another server took the port")
            except OSError as error:
                outcomes.append(errno.errorcode[error.errno])
            # The front ends still bind it, and serve it.
            with shared_port_socket(HOST, port) as frontend:
                frontend.listen()
                frontend.setblocking(True)
                with socket.create_connection((HOST, port), timeout=10):
                    accepted, _ = frontend.accept()
                    accepted.close()
            outcomes.append("served")
            return 0

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, "")  # serve sets it: restored after the test
    monkeypatch.setattr("app.processes.ProcessTree", Tree)
    assert serve_processes(Settings(host=HOST, port=port)) == 0
    assert outcomes == ["EADDRINUSE", "served"]
    with socket.create_server((HOST, port)):  # released once the server exits
        pass


def test_a_port_another_server_listens_on_is_unavailable() -> None:
    with socket.create_server((HOST, 0)) as taken:
        port = taken.getsockname()[1]
        with pytest.raises(PortUnavailable, match=f"cannot listen on {HOST}:{port}: Address"):
            reserve_shared_port(HOST, port)


def test_a_port_another_steadyserve_holds_is_unavailable() -> None:
    """Its front ends' sockets (SO_REUSEPORT) would let ours in, and split its traffic."""
    port = free_port()
    with reserve_shared_port(HOST, port), pytest.raises(PortUnavailable):
        reserve_shared_port(HOST, port)


def test_port_0_is_unavailable() -> None:
    with pytest.raises(PortUnavailable, match="port 0"):
        reserve_shared_port(HOST, 0)


def test_the_reservation_itself_takes_no_connection() -> None:
    """It never listens: with every front end restarting, a client is refused at once (and
    retried elsewhere), not left in a backlog nobody accepts."""
    port = free_port()
    with reserve_shared_port(HOST, port), pytest.raises(ConnectionRefusedError):
        socket.create_connection((HOST, port), timeout=10).close()
