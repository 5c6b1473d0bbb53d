"""Start real steadyserve processes on 127.0.0.1 for end-to-end tests.

Each server is a child process started by the test and stopped by PID; readiness is
observed by polling `/readyz` (bounded by a timeout), never by sleeping a fixed time. The
process handling is loadtest/localserver.py's, shared with the benches; what is here is
what only tests need (their fast settings, the rejection counts).
"""

from __future__ import annotations

import contextlib
import urllib.request
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from loadtest.localserver import (
    REPO_ROOT,
    ServeProcess,
    free_port,
    http_status,
    pin_to,
    spawn_serve,
)

# Re-exported: the tests import these from here.
__all__ = [
    "FAST_TEST_ENV",
    "REPO_ROOT",
    "ServerProcess",
    "free_port",
    "http_status",
    "pin_to",
    "running_server",
    "start_server",
]

# Small buckets keep warm-up short in tests; the shapes still cover batching.
FAST_TEST_ENV: dict[str, str] = {
    "STEADY_LENGTH_BUCKETS": "[16,32,64]",
    "STEADY_MAX_BATCH_SIZE": "16",
    "STEADY_TORCH_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


class ServerProcess(ServeProcess):
    """A test's server: a `ServeProcess` that also reads its refusals."""

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
    process = spawn_serve(port, {**FAST_TEST_ENV, **(env or {})}, log_path, cpus)
    return ServerProcess(process, port, log_path)


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
        server.wait_ready()
        yield server
    finally:
        server.stop(timeout_s=30)
