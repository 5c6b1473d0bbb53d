"""The probe verdicts a front end and the supervisor both give, from the same facts."""

from __future__ import annotations

import asyncio
import json
import socket

from app.engine.protocol import EngineRestart, EngineStatus
from app.probes import ProbeListener, liveness, probe_response, readiness


def engine(state: str = "ready", healthy: bool = True, problem: str | None = None) -> EngineStatus:
    return EngineStatus(
        engine_id="e1", pid=42, state=state, warmup_done=3, warmup_total=3, healthy=healthy,
        backlog_s=0.0, seconds_per_input=0.001, queued_inputs=0, published_at=1.0,
        problem=problem,
    )  # fmt: skip


def test_ready_only_with_a_ready_engine_a_front_end_and_no_drain() -> None:
    assert readiness(engine(), None, draining=False, can_serve=True).ready
    assert readiness(engine("warming_up"), None, False, True).status == "warming_up"
    assert readiness(None, None, False, True).status == "engine_unavailable"
    assert readiness(engine(), None, draining=True, can_serve=True).status == "draining"
    assert readiness(engine(), None, False, can_serve=False).status == "frontend_unavailable"
    failed = readiness(engine(), "front-end start-up failed: OSError", False, True)
    assert (failed.status, failed.problem) == ("failed", "front-end start-up failed: OSError")


def test_an_engine_restart_under_way_is_said_until_an_engine_is_ready() -> None:
    restart = EngineRestart("engine 7 exited by signal SIGKILL", attempt=2, backoff_s=2.0)
    said = "engine 7 exited by signal SIGKILL; restart 2 under way (after a 2 s back-off)"
    assert readiness(None, None, False, True, restart).problem == said
    assert readiness(engine("loading"), None, False, True, restart).problem == said
    failed = readiness(
        engine("failed", problem="start-up failed: OSError"), None, False, True, restart
    )
    assert failed.problem == f"start-up failed: OSError; {said}"
    assert readiness(engine(), None, False, True, restart).problem is None  # ready: cleared
    assert readiness(engine(), None, True, True, restart).problem is None  # draining


def test_alive_unless_start_up_failed_or_batches_keep_failing() -> None:
    assert liveness(engine(), None) is None
    assert liveness(None, None) is None  # restarting: readiness's business, not liveness's
    said = "model 'minilm': 5 consecutive batches failed (RuntimeError)"
    broken = engine(healthy=False, problem=said)
    assert liveness(broken, None) == said
    assert liveness(engine("failed", problem="start-up failed: OSError"), None) is not None
    assert liveness(engine(), "front-end start-up failed: OSError") is not None


def test_a_model_failing_its_batches_leaves_the_replica_ready_for_liveness_to_restart() -> None:
    """Readiness once dropped with `healthy`: a replica taken out gets no request whose
    success clears the count (only a restart brought it back), and one model failing on
    every replica emptied the Service for the models still serving."""
    said = "model 'minilm': 5 consecutive batches failed (RuntimeError)"
    broken = engine(healthy=False, problem=said)
    assert readiness(broken, None, draining=False, can_serve=True).ready
    assert liveness(broken, None) == said


def test_probe_responses() -> None:
    ready = readiness(engine(), None, False, True)
    status, body = probe_response("/readyz", ready, None)
    assert status == 200
    assert json.loads(body) == {
        "status": "ready", "warmup": {"done": 3, "total": 3}, "engine": {"pid": 42},
    }  # fmt: skip
    assert probe_response("/healthz", ready, "engine unhealthy")[0] == 503
    assert probe_response("/healthz", ready, None) == (200, b'{"status":"ok"}')
    assert probe_response("/other", ready, None)[0] == 404


async def test_a_request_longer_than_a_probe_is_closed_unanswered() -> None:
    """`_MAX_REQUEST_BYTES` (8 KiB) was never passed to the listener: heads up to the
    default 64 KiB were read and answered."""
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]

    async def scrape() -> bytes:
        return b""

    listener = ProbeListener("127.0.0.1", port, lambda path: (200, b"{}"), scrape)
    await listener.start()

    async def ask(path: str) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(f"GET {path} HTTP/1.1\r\nhost: probe\r\n\r\n".encode())
        await writer.drain()
        try:
            answer = await asyncio.wait_for(reader.read(), 10)
        except ConnectionResetError:  # closed with some of the request unread
            answer = b""
        writer.close()
        return answer

    try:
        assert (await ask("/healthz")).startswith(b"HTTP/1.1 200 OK")
        assert await ask("/healthz?" + "x" * 8192) == b""
        assert (await ask("/healthz?" + "x" * 7000)).startswith(b"HTTP/1.1 200 OK")
    finally:
        await listener.close()
