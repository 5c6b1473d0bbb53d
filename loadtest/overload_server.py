"""The `steadyserve serve` an overload bench runs, and what it reports: `start_server` starts
it (with a probe port), `Server` is its handle (readiness, the engine's and front ends' pids,
also read by `engine_pid` and `frontend_pids` for any such tree),
`HealthProbe` times its /healthz while load runs, and `refusal_counts` reads its own refusal
counters from /metrics once it is idle. Used by the overload and generation benches from
their main thread; a `HealthProbe` polls on a thread of its own.
"""

from __future__ import annotations

import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from app.settings import Settings
from loadtest.localserver import ServeProcess, free_port, get_json, served_settings, spawn_serve
from loadtest.proctree import command_line, descendants
from loadtest.wrk import wrk_timeout_s

PAUSED_REFUSALS = "steadyserve_refusals_paused_total"
REJECTED = "steadyserve_rejected_total"


@dataclass(frozen=True)
class RefusalCounts:
    """The server's own refusal counters (its /metrics), compared before and after a run.

    `paused`: refusals answered by pausing their connection, i.e. how many of the run's
    refusals its clients resent faster than admissions paid for
    (`app/api/refusal_budget.py`). `after_body`: refusals of requests that were let in
    before the body was read, then refused by the token bucket or the engine (a model
    label; shedding from headers has none): each cost the front end a body, a parse and
    a tokenization, and the client as long."""

    paused: float
    after_body: float

    def __sub__(self, earlier: RefusalCounts) -> RefusalCounts:
        return RefusalCounts(self.paused - earlier.paused, self.after_body - earlier.after_body)


IDLE_GAUGES = ("steadyserve_inflight_requests", "steadyserve_queue_depth")


def _metrics_text(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text: str = response.read().decode()
    return text


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Until nothing is in flight or queued: what a previous phase left in the server (a
    flood's requests whose clients are gone, refused or expired later) is counted in the
    phase it belongs to, not in the next one's refusals."""
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at:
        levels = [
            float(value)
            for name, _, value in (
                line.rpartition(" ") for line in _metrics_text(base_url).splitlines()
            )
            if name in IDLE_GAUGES
        ]
        if levels and not any(levels):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{base_url} still had work in flight after {timeout_s:g} s")


def refusal_counts(base_url: str) -> RefusalCounts:
    """The counters once the server is idle (`wait_until_idle`)."""
    wait_until_idle(base_url)
    text = _metrics_text(base_url)
    paused: float | None = None
    after_body = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == PAUSED_REFUSALS:
            paused = float(value)
        elif name.startswith(REJECTED + "{") and 'model=""' not in name:
            after_body += float(value)
    if paused is None:
        raise RuntimeError(f"{PAUSED_REFUSALS} is not in {base_url}/metrics")
    return RefusalCounts(paused, after_body)


@dataclass(frozen=True)
class Server(ServeProcess):
    """The bench's server: a `ServeProcess` (readiness, log, stop) with its supervisor's
    probe port, the settings it serves with, and the pids of the processes it runs."""

    probe_url: str  # the supervisor's probe port (STEADY_HEALTH_PORT)
    settings: Settings  # what it read from its environment (`served_settings`)

    @property
    def wrk_timeout_s(self) -> int:
        """wrk's `--timeout` for this server: past its longest deadline."""
        return wrk_timeout_s(self.settings)

    def engine_pid(self) -> int | None:
        return engine_pid(self.base_url)

    def frontend_pids(self) -> list[int]:
        return frontend_pids(self.process.pid, self.base_url)


def engine_pid(base_url: str) -> int | None:
    """The engine process's pid, as the server at `base_url` reports it (/readyz)."""
    engine = get_json(f"{base_url}/readyz")[1].get("engine")
    return int(engine["pid"]) if isinstance(engine, dict) else None


def frontend_pids(root: int, base_url: str) -> list[int]:
    """The front-end processes of the `steadyserve serve` tree whose supervisor is `root`
    and which serves `base_url`: its spawned children other than the engine."""
    engine = engine_pid(base_url)
    return [
        pid
        for pid in descendants(root)
        if pid not in (root, engine) and "spawn_main" in command_line(pid)
    ]


class HealthProbe:
    """GET /healthz every 100 ms on a new connection each time, as a kubelet does."""

    def __init__(self, base_url: str) -> None:
        self._url = f"{base_url}/healthz"
        self._stop = threading.Event()
        self.latencies_ms: list[float] = []
        self.failures = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            started = time.perf_counter()
            status, _ = get_json(self._url, timeout=10)
            if status != 200:
                self.failures += 1
            self.latencies_ms.append((time.perf_counter() - started) * 1000)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def start_server(port: int, env: dict[str, str], log_path: Path) -> Server:
    """`steadyserve serve` on `port` with `env`, and a free probe port; not waited for."""
    probe_port = free_port()
    env = {"STEADY_HEALTH_PORT": str(probe_port), **env}
    settings = served_settings(env)
    process = spawn_serve(port, env, log_path)
    return Server(process, port, log_path, f"http://127.0.0.1:{probe_port}", settings)
