"""Liveness and readiness verdicts, and the probe listener of the process tree.

The verdicts are pure: a front end (`/healthz`, `/readyz` on the traffic port) and the
supervisor (its own probe port) reach them from the same facts, so both answer alike.

`ProbeListener` serves those two paths on `STEADY_HEALTH_PORT` from the supervisor, a process
that carries no traffic: however many connections flood the front ends, a kubelet's probe is
answered in well under 100 ms there. With `STEADY_ENGINE=inprocess` the one process serves
it on its own event loop, with the traffic (so the image's HEALTHCHECK and the Kubernetes
probes find a listener; a flood there delays it like the traffic port). Event loop thread
of the process that serves it only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import orjson

from app.engine.protocol import EngineRestart, EngineStatus
from app.schemas import error_object

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Readiness:
    ready: bool
    status: str
    warmup_done: int
    warmup_total: int
    problem: str | None = None
    engine_pid: int | None = None

    def body(self) -> dict[str, object]:
        body: dict[str, object] = {
            "status": self.status,
            "warmup": {"done": self.warmup_done, "total": self.warmup_total},
        }
        if self.problem:
            body["problem"] = self.problem
        if self.engine_pid is not None:
            body["engine"] = {"pid": self.engine_pid}
        return body


def restart_problem(restart: EngineRestart) -> str:
    """What `/readyz` says of an engine restart under way: why the last engine was lost."""
    return (
        f"{restart.why}; restart {restart.attempt} under way "
        f"(after a {restart.backoff_s:g} s back-off)"
    )


def readiness(
    engine: EngineStatus | None,
    startup_error: str | None,
    draining: bool,
    can_serve: bool,
    restart: EngineRestart | None = None,
) -> Readiness:
    """Ready once the engine has warmed up every shape, nothing failed and the server is
    not draining; `can_serve` is whether the front end(s) are up to take traffic. `restart`:
    the engine restart under way (its supervisor's word), said until an engine is ready:
    why the last engine was lost, with no engine connected or a new one still warming up."""
    if startup_error is not None:
        state, problem = "failed", startup_error
    elif draining:
        state, problem = "draining", None
    elif engine is None:
        state, problem = "engine_unavailable", "no engine is connected (restarting?)"
        if restart is not None:
            problem = restart_problem(restart)
    else:
        state, problem = engine.state, engine.problem
        if restart is not None and state != "ready":
            problem = "; ".join(filter(None, (problem, restart_problem(restart))))
    if state == "ready" and not can_serve:
        state, problem = "frontend_unavailable", "no front end is running"
    return Readiness(
        ready=state == "ready",
        status=state,
        warmup_done=engine.warmup_done if engine else 0,
        warmup_total=engine.warmup_total if engine else 0,
        problem=problem,
        engine_pid=engine.pid if engine else None,
    )


def liveness(engine: EngineStatus | None, startup_error: str | None) -> str | None:
    """None while the server should be left running; else why it should be restarted (its
    start-up failed, or the engine's batches keep failing). An engine that is restarting
    is not a reason: readiness covers it."""
    if startup_error is not None:
        return startup_error
    if engine is not None and (engine.state == "failed" or not engine.healthy):
        return engine.problem or "engine unhealthy"
    return None


# A probe path's answer, from the readiness verdict and why liveness fails (None: alive).
ProbeAnswer = Callable[[Readiness, str | None], tuple[int, bytes]]


def _healthz(ready: Readiness, alive_problem: str | None) -> tuple[int, bytes]:
    if alive_problem is not None:
        return 503, orjson.dumps({"status": "unhealthy", "problem": alive_problem})
    return 200, orjson.dumps({"status": "ok"})


def _readyz(ready: Readiness, alive_problem: str | None) -> tuple[int, bytes]:
    return (200 if ready.ready else 503), orjson.dumps(ready.body())


HEALTHZ = "/healthz"
READYZ = "/readyz"
# The probe port's routes: `probe_response` (so `ProbeListener`, in the supervisor and in the
# in-process server) answers these paths and 404s any other. The front end's routes of the
# same names (app/api/health.py) answer through it too. tests/deploy/test_served_paths.py
# checks the image's HEALTHCHECK and every Kubernetes probe on this port against these keys.
PROBE_ROUTES: Mapping[str, ProbeAnswer] = MappingProxyType({HEALTHZ: _healthz, READYZ: _readyz})


def probe_response(path: str, ready: Readiness, alive_problem: str | None) -> tuple[int, bytes]:
    """Status and JSON body of GET `path` (a key of `PROBE_ROUTES`); 404 otherwise."""
    route = PROBE_ROUTES.get(path)
    if route is None:
        return 404, orjson.dumps(error_object("not_found", path))
    return route(ready, alive_problem)


_REASONS = {200: b"OK", 404: b"Not Found", 503: b"Service Unavailable", 400: b"Bad Request"}
# A probe's request line and headers; anything longer is not a probe, and its connection is
# closed unanswered (the listener's read limit: the default, 64 KiB, read 8x more).
_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT_S = 2.0


class ProbeListener:
    """A minimal HTTP/1.1 listener for GET /healthz and /readyz, one request per
    connection. `answer(path)` gives the status and body (`probe_response`, which routes by
    `PROBE_ROUTES`)."""

    def __init__(self, host: str, port: int, answer: Callable[[str], tuple[int, bytes]]) -> None:
        self._host = host
        self._port = port
        self._answer = answer
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=_MAX_REQUEST_BYTES
        )
        log.info("probes on %s:%d (%s)", self._host, self._port, ", ".join(PROBE_ROUTES))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _READ_TIMEOUT_S)
            method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            status, body = (
                self._answer(path.split("?", 1)[0]) if method in ("GET", "HEAD") else (400, b"")
            )
            writer.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % (status, _REASONS.get(status, b""), len(body))
            )
            if method == "GET":
                writer.write(body)
            await writer.drain()
        except (
            TimeoutError,
            ValueError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            ConnectionError,
        ):
            pass  # not a well-formed probe, or the prober went away: nothing to answer
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
