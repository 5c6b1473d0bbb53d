"""Starting `steadyserve serve` for a bench (loadtest/overload_server.py) and for a test
(tests/support/server.py) is one piece of code, loadtest/localserver.py: the same command,
working directory and environment, and the same readiness wait. Here a stand-in for the
interpreter (a shell script) takes the server's place, so nothing is served."""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from loadtest import localserver, overload_server
from loadtest.localserver import REPO_ROOT, ServeProcess, free_port, start_serve
from tests.support import server as test_server


def stand_in_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str) -> None:
    """`sys.executable` becomes a shell script running `body` (the server's command is
    `sys.executable -m app.cli serve ...`)."""
    script = tmp_path / "python"
    script.write_text(f"#!/bin/sh\n{body}\n")
    script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(script))


def started_by_a_bench(tmp_path: Path, port: int, env: dict[str, str]) -> ServeProcess:
    return overload_server.start_server(port, env, tmp_path / "bench.log")


def started_by_a_test(tmp_path: Path, port: int, env: dict[str, str]) -> ServeProcess:
    return test_server.start_server(tmp_path, env, port)


@pytest.mark.parametrize("start", [started_by_a_bench, started_by_a_test], ids=["bench", "tests"])
def test_a_bench_and_a_test_start_the_server_alike_and_quote_the_log_of_an_early_exit(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    start: Callable[[Path, int, dict[str, str]], ServeProcess],
) -> None:
    """The bench's wait said only "server exited with 3", without the log that says why."""
    stand_in_python(
        tmp_path,
        monkeypatch,
        'echo "args: $*"; echo "cwd: $(pwd)"\n'
        'echo "offline=$HF_HUB_OFFLINE threads=$STEADY_TORCH_THREADS"\n'
        "exit 3",
    )
    port = free_port()
    server = start(tmp_path, port, {"STEADY_TORCH_THREADS": "2"})
    with pytest.raises(RuntimeError, match="exited with 3") as exited:
        server.wait_ready(30)
    message = str(exited.value)
    assert f"args: -m app.cli serve --host 127.0.0.1 --port {port}" in message
    assert f"cwd: {REPO_ROOT}" in message
    assert "offline=1 threads=2" in message  # the caller's env over the defaults
    assert server.base_url == f"http://127.0.0.1:{port}"


class KernelOffering:
    """A stand-in for `socket.socket` whose bind to port 0 gets the ports given, in turn, as
    the kernel may offer a port again that was handed out but is not bound (yet)."""

    def __init__(self, ports: list[int]) -> None:
        self._ports = iter(ports)

    def __call__(self) -> KernelOffering:
        return self

    def __enter__(self) -> KernelOffering:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def bind(self, address: tuple[str, int]) -> None:
        assert address == ("127.0.0.1", 0)
        self._port = next(self._ports)

    def getsockname(self) -> tuple[str, int]:
        return "127.0.0.1", self._port


def test_free_port_never_hands_out_a_port_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replica whose start-up fails never binds its port: the kernel offered it again, and
    tests/e2e/test_envoy_e2e.py could give it to the Envoy in front of that replica."""
    monkeypatch.setattr(localserver, "_HANDED_OUT", set(), raising=False)  # none given yet
    kernel = KernelOffering([40001, 40001, 40002])
    monkeypatch.setattr(localserver, "socket", SimpleNamespace(socket=kernel))
    assert [free_port(), free_port()] == [40001, 40002]


@pytest.fixture
def readyz() -> Iterator[tuple[int, list[int]]]:
    """A stand-in /readyz on 127.0.0.1: its port, and the statuses it answers in turn (the
    last one from then on)."""
    statuses = [503]

    class Answering(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
            self.send_response(status if self.path == "/readyz" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    listener = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answering)
    thread = threading.Thread(target=listener.serve_forever, daemon=True)
    thread.start()
    try:
        yield listener.server_port, statuses
    finally:
        listener.shutdown()
        listener.server_close()


def test_wait_ready_polls_readyz_until_200_and_stop_ends_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readyz: tuple[int, list[int]]
) -> None:
    port, statuses = readyz
    statuses[:] = [503, 503, 200]
    stand_in_python(tmp_path, monkeypatch, "exec sleep 300")
    server = start_serve(port, {}, tmp_path / "server.log")
    try:
        assert server.wait_ready(30) >= 0
        assert statuses == [200]  # both 503s were polled past
    finally:
        server.stop(timeout_s=10)
    assert server.process.returncode == -signal.SIGTERM


def test_wait_ready_gives_up_after_its_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, readyz: tuple[int, list[int]]
) -> None:
    port, _ = readyz  # 503 for ever
    stand_in_python(tmp_path, monkeypatch, "echo starting; exec sleep 300")
    server = start_serve(port, {}, tmp_path / "server.log")
    try:
        with pytest.raises(TimeoutError, match=r"not ready after 0.3 s:\nstarting"):
            server.wait_ready(0.3)
    finally:
        server.stop(timeout_s=10)


def _gone(pid: int) -> bool:
    """Whether `pid` has exited (a zombie nobody reaped counts: it runs nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return True
    return fields[0] in ("Z", "X")


def test_a_server_started_for_a_test_or_bench_ends_when_its_starter_dies(tmp_path: Path) -> None:
    """pytest-timeout ends a hung run with `os._exit`, which runs no `finally`: the servers
    its tests had started kept running (and using the CPUs) into the next run. A server
    started by `spawn_serve` now gets SIGTERM when the process that started it dies."""
    stand_in = tmp_path / "python"
    stand_in.write_text("#!/bin/sh\nexec sleep 120\n")
    stand_in.chmod(0o755)
    starter = (
        "import os, sys\n"
        "from pathlib import Path\n"
        "from loadtest.localserver import spawn_serve\n"
        f"sys.executable = {str(stand_in)!r}\n"
        f"child = spawn_serve(1, {{}}, Path({str(tmp_path / 'log')!r}))\n"
        "print(child.pid, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", starter], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    server_pid = int(done.stdout)
    give_up_at = time.monotonic() + 20
    while not _gone(server_pid):  # bounded polling of the kernel's process table
        if time.monotonic() > give_up_at:
            os.kill(server_pid, signal.SIGKILL)
            raise AssertionError("the server outlived the process that started it")
        time.sleep(0.05)
