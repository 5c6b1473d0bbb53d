"""Start real steadyserve processes on 127.0.0.1 for end-to-end tests.

Each server is a child process started by the test and stopped by PID; readiness is
observed by polling `/readyz` (bounded by a timeout), never by sleeping a fixed time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

REPO_ROOT = Path(__file__).resolve().parents[2]

# Small buckets keep warm-up short in tests; the shapes still cover batching.
FAST_TEST_ENV: dict[str, str] = {
    "STEADY_LENGTH_BUCKETS": "[16,32,64]",
    "STEADY_MAX_BATCH_SIZE": "16",
    "STEADY_TORCH_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        return self.process.wait(timeout=timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)

    def rejections(self) -> Counter[tuple[str, str]]:
        """`steadyserve_rejected_total` from its /metrics, by (model, reason); model "" for
        requests refused before their body was read."""
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as response:
            text = response.read().decode()
        counts: Counter[tuple[str, str]] = Counter()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "steadyserve_rejected_total":
                    counts[(sample.labels["model"], sample.labels["reason"])] += int(sample.value)
        return counts


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


def wait_until_ready(server: ServerProcess, timeout: float = 120.0) -> None:
    """Poll /readyz until 200; fail with the server's log if it exits or times out."""
    give_up_at = time.monotonic() + timeout
    while time.monotonic() < give_up_at:
        if server.process.poll() is not None:
            raise RuntimeError(f"server exited with {server.process.returncode}:\n{server.log()}")
        if http_status(f"{server.base_url}/readyz", timeout=1.0) == 200:
            return
        time.sleep(0.1)  # polling interval, not synchronisation: the loop checks the state
    raise TimeoutError(f"server not ready after {timeout}s:\n{server.log()}")


def pin_to(cpus: set[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` confining a child (and everything it starts) to `cpus`."""
    if cpus is None:
        return None
    return lambda: os.sched_setaffinity(0, cpus)


def start_server(
    tmp_path: Path,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    cpus: set[int] | None = None,
) -> ServerProcess:
    """Start `steadyserve serve` on 127.0.0.1 (fast test settings + `env`), not waiting;
    `cpus` confines it (engine and front ends) to those CPUs."""
    port = port or free_port()
    log_path = tmp_path / f"steadyserve-{port}.log"
    full_env = {**os.environ, **FAST_TEST_ENV, **(env or {})}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO_ROOT,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            preexec_fn=pin_to(cpus),
        )
    return ServerProcess(process=process, port=port, log_path=log_path)


@contextlib.contextmanager
def running_server(
    tmp_path: Path,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    cpus: set[int] | None = None,
) -> Iterator[ServerProcess]:
    """A ready steadyserve on 127.0.0.1; stopped by PID on exit if still running: SIGTERM
    (it drains and removes its run directory under /tmp, which a kill -9 leaves behind),
    then SIGKILL if it has not exited within 30 s."""
    server = start_server(tmp_path, env, port, cpus)
    try:
        wait_until_ready(server)
        yield server
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
