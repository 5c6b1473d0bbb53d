"""Liveness and readiness verdicts, and the probe listener of the process tree.

The verdicts are pure: a front end (`/healthz`, `/readyz` on the traffic port) and the
supervisor (its own probe port) reach them from the same facts, so both answer alike. Each
process logs them once per change (`PROBE_VERDICTS`, as its probes are answered).

`ProbeListener` serves those two paths on `STEADY_HEALTH_PORT` from the supervisor, a process
that carries no traffic: however many connections flood the front ends, a kubelet's probe is
answered in well under 100 ms there. It serves `/metrics` too, the front ends' exposition
rendered by the same code (`app/metrics.py`), so Prometheus scrapes apart from the flood and
is let onto this port alone (deploy/k8s: a NetworkPolicy cannot tell /metrics from /infer on
the traffic port). With `STEADY_ENGINE=inprocess` the one process serves it on its own event
loop, with the traffic (so the image's HEALTHCHECK and the Kubernetes probes find a listener;
a flood there delays it like the traffic port). Event loop thread of the process that
serves it only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from app.api.write_stall import abort_unflushed
from app.engine.protocol import EngineRestart, EngineStatus
from app.log_limits import VerdictLog
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
        state, problem = "frontend_unavailable", "no front end is serving"
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
METRICS = "/metrics"
# The verdicts' routes: `probe_response` answers these paths and 404s any other;
# `ProbeListener` (in the supervisor and in the in-process server) routes every path but
# `METRICS` through it. The front end's routes of the same names (app/api/health.py) answer
# through it too.
PROBE_ROUTES: Mapping[str, ProbeAnswer] = MappingProxyType({HEALTHZ: _healthz, READYZ: _readyz})
# Every path `ProbeListener` serves: the verdicts, and `METRICS` (its `scrape`).
# tests/deploy/test_served_paths.py checks the image's HEALTHCHECK, every Kubernetes probe and
# the ServiceMonitor's scrape on this port against it.
PROBE_PORT_PATHS = frozenset({*PROBE_ROUTES, METRICS})


class ProbeVerdicts:
    """The verdicts a process's probes answered, logged once per change (`VerdictLog`):
    a crash loop, an unkillable engine or failing batches, and why it is not ready."""

    def __init__(self) -> None:
        self._liveness = VerdictLog(log, "liveness", assumed="ok")
        self._readiness = VerdictLog(log, "readiness")

    def note(self, ready: Readiness, alive_problem: str | None) -> None:
        self._liveness.note("ok" if alive_problem is None else "unhealthy", alive_problem)
        self._readiness.note(ready.status, ready.problem)


# This process's (the supervisor's, a front end's, the in-process server's): every answer
# it gives goes through `probe_response`, on whichever port.
PROBE_VERDICTS = ProbeVerdicts()


def probe_response(path: str, ready: Readiness, alive_problem: str | None) -> tuple[int, bytes]:
    """Status and JSON body of GET `path` (a key of `PROBE_ROUTES`); 404 otherwise. The
    verdicts are logged where they changed since the last answer (`PROBE_VERDICTS`)."""
    PROBE_VERDICTS.note(ready, alive_problem)
    route = PROBE_ROUTES.get(path)
    if route is None:
        return 404, orjson.dumps(error_object("not_found", path))
    return route(ready, alive_problem)


_REASONS = {
    200: b"OK", 400: b"Bad Request", 404: b"Not Found", 500: b"Internal Server Error",
    503: b"Service Unavailable",
}  # fmt: skip
_JSON = b"application/json"
# A probe's request line and headers; anything longer is not a probe, and its connection is
# closed unanswered (the listener's read limit: the default, 64 KiB, read 8x more).
_MAX_REQUEST_BYTES = 8192
_READ_TIMEOUT_S = 2.0
# From the request read to the answer written: a scrape's merge (milliseconds; longer while
# the supervisor folds a dead process's files) and a reader that stops reading. Under
# Prometheus's default scrape timeout (10 s), which gives up on a slower one anyway.
_ANSWER_TIMEOUT_S = 5.0


class ProbeListener:
    """A minimal HTTP/1.1 listener for GET /healthz, /readyz and /metrics, one request per
    connection. `answer(path)` gives the status and JSON body of any path but /metrics
    (`probe_response`, which routes by `PROBE_ROUTES`); `scrape()` the Prometheus text (the
    process's own /metrics, which renders off the event loop). One scrape runs at a time:
    one that arrives meanwhile shares its answer, so a burst costs one render, one thread."""

    def __init__(
        self,
        host: str,
        port: int,
        answer: Callable[[str], tuple[int, bytes]],
        scrape: Callable[[], Awaitable[bytes]],
    ) -> None:
        self._host = host
        self._port = port
        self._answer = answer
        self._scrape = scrape
        self._scraping: asyncio.Future[bytes] | None = None
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=_MAX_REQUEST_BYTES
        )
        paths = ", ".join(sorted(PROBE_PORT_PATHS))
        log.info("probes on %s:%d (%s)", self._host, self._port, paths)

    async def close(self) -> None:
        """Stop listening; a scrape still rendering is let go (its thread ends on its own)."""
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        if self._scraping is not None:
            self._scraping.cancel()

    async def _metrics(self) -> tuple[int, bytes, bytes]:
        if self._scraping is None:
            self._scraping = asyncio.ensure_future(self._scrape())
            self._scraping.add_done_callback(self._scraped)
        try:
            # Shielded: a scraper that gives up does not cancel the others' answer.
            body = await asyncio.shield(self._scraping)
        except Exception:  # logged once, by `_scraped`
            body = orjson.dumps(error_object("internal_error", "the metrics could not be read"))
            return 500, _JSON, body
        return 200, CONTENT_TYPE_LATEST.encode(), body

    def _scraped(self, scrape: asyncio.Future[bytes]) -> None:
        self._scraping = None
        if not scrape.cancelled() and scrape.exception() is not None:
            log.error("cannot render the metrics: %r", scrape.exception())

    async def _route(self, method: str, path: str) -> tuple[int, bytes, bytes]:
        """Status, content type and body of `method` `path` (its query left off)."""
        if method not in ("GET", "HEAD"):
            return 400, _JSON, b""
        if path == METRICS:
            return await self._metrics()
        status, body = self._answer(path)
        return status, _JSON, body

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(_READ_TIMEOUT_S):
                head = await reader.readuntil(b"\r\n\r\n")
            method, path, _ = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ", 2)
            async with asyncio.timeout(_ANSWER_TIMEOUT_S):
                status, content_type, body = await self._route(method, path.split("?", 1)[0])
                writer.write(
                    b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n"
                    b"connection: close\r\n\r\n"
                    % (status, _REASONS.get(status, b""), content_type, len(body))
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
            abort_unflushed(writer.transport)  # an answer its reader stopped reading
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
