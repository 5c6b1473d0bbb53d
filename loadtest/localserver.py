"""What a bench or a test needs to start a server on this machine and reach it: `REPO_ROOT`
(the working directory servers start in, and where results go by default), a `free_port` to
give it (never the same one twice), `http_status` / `get_json`, plain blocking GETs for
readiness polls and the server's JSON answers, `served_settings`, the settings a server
given some environment reads, and `spawn_serve` / `start_serve`, which start `steadyserve
serve` as a child process whose `ServeProcess` handle waits for it to be ready and stops
it by PID.

One copy for the benches here and for tests/support/server.py (tests may import loadtest;
loadtest never imports tests). Any thread may call these; a `ServeProcess` belongs to the
thread that started it.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.settings import Settings
from loadtest.proctree import stop_process

_PR_SET_PDEATHSIG = 1  # prctl(2)

REPO_ROOT = Path(__file__).resolve().parents[1]

# How much of a server's log a failed readiness wait quotes (a bench's log can be long).
LOG_TAIL_CHARS = 20_000


def http_status(url: str, timeout: float = 2.0) -> int | None:
    """The status of a GET of `url`, None when nothing answered within `timeout` s."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


# Every port `free_port` handed out in this process: a server given one may bind it late, or
# never (one whose start-up fails), and the kernel would offer it again meanwhile.
_HANDED_OUT: set[int] = set()
_HANDED_OUT_LOCK = threading.Lock()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the server binds it after), and
    that this process was never given before: two servers, or a server and an Envoy, started
    in one test never share a port, even where the first has not bound its port (yet)."""
    with _HANDED_OUT_LOCK:
        while True:
            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                port = int(sock.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port


def get_json(url: str, timeout: float = 5.0) -> tuple[int | None, dict[str, Any]]:
    """The status and JSON body of a GET of `url`: (None, {}) when nothing answered or a 2xx
    body is not JSON; an error status whose body is not JSON raises ValueError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None, {}


def served_settings(env: Mapping[str, str]) -> Settings:
    """The settings a server started with `env` over this process's environment (as
    `spawn_serve` starts one) reads, parsed as the server parses its environment; raises as
    its start would (a value that cannot be parsed, or is invalid)."""
    # Imported here: the checker's package brings torch, which the callers mostly lack.
    from app.checkconfig.pod_settings import settings_from_environment

    return settings_from_environment({**os.environ, **env})[0]


def pin_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` confining a child (and everything it starts) to `cpus`."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def dies_with_this_process(cpus: set[int] | None) -> Callable[[], None]:
    """A `preexec_fn`: the child gets SIGTERM when the process that starts it dies (even by
    kill -9, or pytest-timeout's `os._exit`, which runs no `finally`), so no server outlives
    its test or bench; `cpus`, if given, confines it as `pin_to` does. Start children from
    the main thread: the kernel sends the signal when the starting thread ends."""
    pin = pin_to(cpus)

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if pin is not None:
            pin()

    return preexec


def spawn_serve(
    port: int, env: Mapping[str, str], log_path: Path, cpus: set[int] | None = None
) -> subprocess.Popen[bytes]:
    """Start `steadyserve serve` on 127.0.0.1:`port`, not waiting for it: run from
    `REPO_ROOT` with this process's environment, `HF_HUB_OFFLINE=1` and then `env` over it,
    its stdout and stderr written to `log_path`; `cpus` confines it (supervisor, engine
    and front ends) to those CPUs. It stops when this process dies."""
    with log_path.open("wb") as log_file:
        return subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO_ROOT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=dies_with_this_process(cpus),
        )


@dataclass(frozen=True)
class ServeProcess:
    """A `steadyserve serve` child (`spawn_serve`) and where it listens and logs."""

    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120.0) -> float:
        """Poll /readyz until it answers 200; the seconds that took. Raises RuntimeError
        if the server exits first, TimeoutError after `timeout_s`, each quoting the end of
        its log."""
        started = time.monotonic()
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {self.process.returncode}:\n{self._log_tail()}"
                )
            if http_status(f"{self.base_url}/readyz") == 200:
                return time.monotonic() - started
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"server not ready after {timeout_s:g} s:\n{self._log_tail()}")
            time.sleep(0.1)  # polling interval, not synchronisation: the loop checks the state

    def _log_tail(self) -> str:
        text = self.log()
        if len(text) <= LOG_TAIL_CHARS:
            return text
        tail = text[-LOG_TAIL_CHARS:]
        return f"[the last {LOG_TAIL_CHARS} characters of {self.log_path}]\n{tail}"

    def terminate(self) -> None:
        """SIGTERM (it drains) if it is still running; not waited for."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL if it is still running, then reap it."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL if it has not exited within `timeout_s` (`stop_process`)."""
        stop_process(self.process, timeout_s)


def start_serve(
    port: int, env: Mapping[str, str], log_path: Path, cpus: set[int] | None = None
) -> ServeProcess:
    """`spawn_serve`, with its handle."""
    return ServeProcess(spawn_serve(port, env, log_path, cpus), port, log_path)
