"""The engine process under real failure: killed with SIGKILL under load, it is restarted
and warmed up while the front end keeps answering; nothing waits past its deadline, nothing
is lost or answered twice. Real processes on 127.0.0.1."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.api.errors import RETRY_ELSEWHERE_HEADER
from loadtest.proctree import command_line, descendants
from tests.support.server import ServerProcess, free_port, running_server

pytestmark = pytest.mark.e2e

TIMEOUT_MS = 3000


def readyz(server: ServerProcess, port: int | None = None) -> tuple[int, dict[str, object]]:
    """/readyz's status and body; status 0 where no answer came (no front end listening,
    a reset, the probe's timeout: the engine's reload starves the CPUs), which every
    caller takes as not ready yet."""
    base_url = server.base_url if port is None else f"http://127.0.0.1:{port}"
    try:
        try:
            with urllib.request.urlopen(f"{base_url}/readyz", timeout=2) as response:
                return int(response.status), json.loads(response.read())
        except urllib.error.HTTPError as error:
            return int(error.code), json.loads(error.read())
    except (OSError, http.client.HTTPException) as error:  # URLError, timeouts, resets
        return 0, {"unanswered": repr(error)}


def serves(server: ServerProcess) -> bool:
    """Ready on the traffic port; false while no front end listens (one per 2 CPUs)."""
    return readyz(server)[0] == 200


def inflight(server: ServerProcess) -> float:
    """`steadyserve_inflight_requests` from /metrics: requests admitted and not yet left."""
    with urllib.request.urlopen(f"{server.base_url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "steadyserve_inflight_requests"
    )


def engine_pid(server: ServerProcess) -> int:
    """The engine's pid, from the first /readyz answered 200 (within 30 s)."""
    answers: list[tuple[int, dict[str, object]]] = []
    wait_for(lambda: answers.append(readyz(server)) or answers[-1][0] == 200, 30, "/readyz 200")
    engine = answers[-1][1]["engine"]
    assert isinstance(engine, dict)
    return int(engine["pid"])


class ClosedLoop:
    """Threads that each send one request after another until stopped, recording (status,
    error type, seconds, whether a proxy may retry it elsewhere) per request."""

    def __init__(self, server: ServerProcess, threads: int) -> None:
        self._server = server
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.results: list[tuple[int | str, str | None, float, bool]] = []
        self._threads = [threading.Thread(target=self._run, args=(n,)) for n in range(threads)]

    def _run(self, worker: int) -> None:
        with httpx.Client(base_url=self._server.base_url, timeout=30) as client:
            sent = 0
            while not self._stop.is_set():
                sent += 1
                body = {"inputs": f"worker {worker} request {sent}", "timeout_ms": TIMEOUT_MS}
                started = time.monotonic()
                try:
                    response = client.post("/infer", json=body)
                    outcome: int | str = response.status_code
                    kind = response.json().get("error", {}).get("type") if outcome != 200 else None
                    elsewhere = RETRY_ELSEWHERE_HEADER in response.headers
                except httpx.HTTPError as error:
                    outcome, kind, elsewhere = type(error).__name__, None, False
                with self._lock:
                    self.results.append((outcome, kind, time.monotonic() - started, elsewhere))

    def count(self, outcome: int | str) -> int:
        with self._lock:
            return sum(1 for r in self.results if r[0] == outcome)

    def __enter__(self) -> ClosedLoop:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)


def wait_for(condition: object, timeout: float, what: str) -> None:
    give_up_at = time.monotonic() + timeout
    while time.monotonic() < give_up_at:
        if callable(condition) and condition():
            return
        time.sleep(0.05)  # polling interval: the loop checks the state
    raise AssertionError(f"timed out waiting for {what}")


def test_an_engine_killed_under_load_is_replaced_and_no_request_is_lost(tmp_path: Path) -> None:
    probes = free_port()
    env = {
        "STEADY_ENGINE_RESTART_BACKOFF_S": "[0.5, 5]",
        "STEADY_MAX_QUEUE_DELAY_MS": "2000",
        "STEADY_HEALTH_PORT": str(probes),
    }
    with running_server(tmp_path, env) as server:
        first_engine = engine_pid(server)
        # The supervisor's probe port says what the traffic port says.
        assert readyz(server, probes) == readyz(server)
        with ClosedLoop(server, threads=8) as load:
            wait_for(lambda: load.count(200) >= 40, 60, "40 answers before the kill")
            os.kill(first_engine, signal.SIGKILL)
            wait_for(lambda: readyz(server)[0] == 503, 10, "/readyz to report the engine gone")
            wait_for(
                lambda: readyz(server, probes)[1].get("status") == "engine_unavailable",
                10,
                "the probe port to report the engine gone",
            )
            # Both probe answers say why, from the supervisor's word, until the new engine
            # is ready (its load and warm-up take seconds).
            why = f"engine {first_engine} exited by signal SIGKILL"
            wait_for(
                lambda: (
                    why in str(readyz(server, probes)[1].get("problem"))
                    and why in str(readyz(server)[1].get("problem"))
                ),
                10,
                "both /readyz answers to say why the engine was lost",
            )
            wait_for(lambda: readyz(server)[0] == 200, 120, "a new engine to be ready")
            wait_for(lambda: readyz(server, probes)[0] == 200, 10, "the probe port to agree")
            answered_before = load.count(200)
            wait_for(lambda: load.count(200) >= answered_before + 40, 60, "answers again")
        second_engine = engine_pid(server)
        # Every request left the server: none stays admitted on the dead engine's account.
        wait_for(lambda: inflight(server) == 0, 30, "no request left in flight")
        engine_lost_counted = sum(
            n for (_, reason), n in server.rejections().items() if reason == "engine_lost"
        )
        log = server.log()
        assert server.process.poll() is None, log  # the server lived through it
    assert second_engine != first_engine
    outcomes = Counter((status, kind) for status, kind, _, _ in load.results)
    # A proxy may retry a not_ready elsewhere, never an engine_lost (a query of death).
    assert all(
        elsewhere == (kind == "not_ready") for _, kind, _, elsewhere in load.results if kind
    ), load.results
    # Every request got an answer: 200, or a retryable 503 (engine lost or not ready yet);
    # no connection error, no 500, nothing hanging.
    allowed = {(200, None), (503, "engine_lost"), (503, "not_ready")}
    assert set(outcomes) <= allowed, outcomes
    assert outcomes[(503, "engine_lost")] + outcomes[(503, "not_ready")] >= 1, outcomes
    # Nothing waited for an answer that never came: the front end's guard against a silent
    # engine would have answered it 503 `not_ready` and logged it (`engine/client.py`).
    assert "never answered" not in log
    # No request was left waiting on the dead engine, checked without a clock: one whose
    # deadline (timeout_ms) passed before it was computed is answered 504 `deadline`, one
    # the engine never answered by then is answered by the front end's guard and logged
    # (above), one never answered at all is the client's ReadTimeout: none is among the
    # allowed outcomes; and none stayed admitted (in flight) once the load stopped. (Each
    # request's time on the client is no measure of it: a connection answered 503
    # `not_ready` has its reads paused for up to refused_read_pause_s, and a shared
    # machine stalls.)
    # Each 503 engine_lost is counted once among the rejections, as the dashboard shows them.
    assert engine_lost_counted == outcomes[(503, "engine_lost")], outcomes
    assert "restarting in" in log


def test_a_front_end_killed_is_reported_to_the_engine_and_replaced(tmp_path: Path) -> None:
    """A front end that dies sends no Cancel for its requests: the supervisor tells the
    engine (`FrontEndGone`), which drops their work, and starts a new front end."""
    with running_server(tmp_path, {"STEADY_ENGINE_RESTART_BACKOFF_S": "[0.5, 5]"}) as server:
        engine = engine_pid(server)

        def frontends() -> set[int]:
            return {
                pid
                for pid in descendants(server.process.pid)
                if pid not in (server.process.pid, engine) and "spawn_main" in command_line(pid)
            }

        before = frontends()
        killed = min(before)
        os.kill(killed, signal.SIGKILL)
        # The engine names it by its identity, fe-<pid>-<token> (`engine/identity.py`).
        said = re.compile(rf"front end fe-{killed}-[0-9a-f]+ exited: dropped the work")
        wait_for(
            lambda: said.search(server.log()) is not None,
            30,
            "the engine to hear of the dead front end",
        )
        # A new front end process, not only a survivor answering (with several front ends).
        wait_for(lambda: len(frontends() - before) == 1, 60, "a replacement front end")
        wait_for(lambda: serves(server), 60, "the server to serve again")
        assert engine_pid(server) == engine  # the engine lived through it
