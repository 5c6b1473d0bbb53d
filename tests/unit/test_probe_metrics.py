"""/metrics on the probe port: the supervisor's (engine-process mode) and the in-process
server's listener answer it with what a front end's /metrics renders, bounded as a probe is.

Prometheus scrapes the probe port (deploy/k8s: the NetworkPolicy admits the monitoring
namespace there only), so a scrape never meets the traffic port's flood and no pod of that
namespace reaches /infer past Envoy's limits."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from app import probes
from app.main import create_app
from app.metrics import MULTIPROCESS_DIR_ENV
from app.probes import PROBE_PORT_PATHS, ProbeListener
from app.processes import ProcessTree
from app.settings import Settings
from loadtest.localserver import REPO_ROOT, free_port
from loadtest.null_engine import NullEngine
from tests.support.asgi import serving

# What a process of the tree writes to the multiprocess directory: the real `Metrics`, some
# labelled series set, in a process of its own (prometheus_client picks its file-backed
# values at import, from the environment).
_WRITER = """
from app.metrics import Metrics
m = Metrics()
m.rejected.labels("m", "queue_full").inc(3)
m.request_duration.labels("m", "embed", "ok").observe(0.02)
m.queue_depth.set(5)
"""


async def get(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    """GET `path` from 127.0.0.1:`port`: status, headers, body (read to the close); status 0
    when the connection closed unanswered."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nhost: probes\r\n\r\n".encode())
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    if not answer:
        return 0, {}, b""
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines)
    return int(status_line.split(" ")[1]), headers, body


def families(text: str | bytes) -> dict[str, str]:
    """Each metric family of a Prometheus text, by name, with its type."""
    text = text.decode() if isinstance(text, bytes) else text
    return {family.name: family.type for family in text_string_to_metric_families(text)}


async def test_the_supervisor_serves_the_front_ends_metrics_on_the_probe_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its probe port answered only /healthz and /readyz: /metrics was a 404 there."""
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    monkeypatch.setenv(MULTIPROCESS_DIR_ENV, str(metrics_dir))
    written = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-c", _WRITER],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
    )
    assert written.returncode == 0, written.stderr
    port = free_port()
    tree = ProcessTree(Settings(health_port=port), tmp_path)
    assert tree._probes is not None
    await tree._probes.start()
    try:
        status, headers, body = await get(port, "/metrics")
    finally:
        await tree._probes.close()
        tree._zmq.destroy(linger=0)
    settings = Settings()
    app = create_app(settings, engine=NullEngine(settings))
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://test"
    ) as client:
        front_end = await client.get("/metrics")
    assert front_end.status_code == 200
    assert status == 200, body
    assert headers["content-type"] == front_end.headers["content-type"] == CONTENT_TYPE_LATEST
    assert families(body) == families(front_end.text)
    # Not vacuous: the written families (and their values) are there.
    assert {"steadyserve_rejected", "steadyserve_queue_depth"} <= families(body).keys()
    assert 'steadyserve_rejected_total{model="m",reason="queue_full"} 3.0' in body.decode()


async def test_the_in_process_server_serves_its_metrics_on_the_probe_port(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With STEADY_ENGINE=inprocess the one process answers the probe port: /metrics
    there was a 404."""
    monkeypatch.delenv(MULTIPROCESS_DIR_ENV, raising=False)
    port = free_port()
    # No telemetry: its samples would add families between the two scrapes.
    settings = Settings(engine="inprocess", health_port=port, spike_reports=False)
    app = create_app(settings, engine=NullEngine(settings))
    async with serving(app, wait_ready=False) as client:
        status, headers, body = await get(port, "/metrics")
        front_end = await client.get("/metrics")
    assert status == 200, body
    assert headers["content-type"] == front_end.headers["content-type"] == CONTENT_TYPE_LATEST
    assert families(body) == families(front_end.text)
    assert {"steadyserve_request_duration_seconds", "steadyserve_queue_depth"} <= families(
        body
    ).keys()


async def listening(
    scrape: Callable[[], Awaitable[bytes]], answer: tuple[int, bytes] = (200, b"{}")
) -> tuple[ProbeListener, int]:
    port = free_port()
    listener = ProbeListener("127.0.0.1", port, lambda path: answer, scrape)
    await listener.start()
    return listener, port


async def test_every_probe_port_path_is_served_and_no_other() -> None:
    """`PROBE_PORT_PATHS`, which the checks of the shipped files read, is what it routes."""

    async def scrape() -> bytes:
        return b"# metrics\n"

    listener, port = await listening(scrape, answer=(404, b"{}"))
    try:
        assert (await get(port, "/metrics"))[0] == 200
        for path in PROBE_PORT_PATHS - {"/metrics"}:  # the verdicts: `answer`, which 404s
            assert (await get(port, path))[0] == 404
        assert (await get(port, "/metric"))[0] == 404
    finally:
        await listener.close()


async def test_scrapes_that_arrive_together_share_one_render(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    renders = 0
    release, all_asked = asyncio.Event(), asyncio.Event()

    async def scrape() -> bytes:
        nonlocal renders
        renders += 1
        await release.wait()
        return b"steadyserve_demo 1.0\n"

    listener, port = await listening(scrape)
    # Each /metrics request, counted as the listener routes it (then answered as ever).
    asking = 0
    route = listener._metrics

    async def counted() -> tuple[int, bytes, bytes]:
        nonlocal asking
        asking += 1
        if asking == 8:
            all_asked.set()
        return await route()

    monkeypatch.setattr(listener, "_metrics", counted)
    try:
        asked = [asyncio.create_task(get(port, "/metrics")) for _ in range(8)]
        await asyncio.wait_for(all_asked.wait(), 10)
        release.set()
        answers = await asyncio.gather(*asked)
        assert renders == 1
        assert {(status, body) for status, _, body in answers} == {(200, b"steadyserve_demo 1.0\n")}
        # The next scrape renders afresh.
        assert (await get(port, "/metrics"))[0] == 200
        assert renders == 2
    finally:
        await listener.close()


async def test_a_failed_render_is_a_500_and_a_slow_one_is_cut_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(probes, "_ANSWER_TIMEOUT_S", 0.3)
    calls = 0

    async def scrape() -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise OSError("no such directory")
        await asyncio.sleep(60)  # a merge stuck behind a lock
        return b""

    listener, port = await listening(scrape)
    try:
        status, _, body = await get(port, "/metrics")
        assert status == 500 and b"internal_error" in body
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert await get(port, "/metrics") == (0, {}, b"")  # closed at the deadline
        assert loop.time() - started < 5
        stuck = listener._scraping
        assert stuck is not None and not stuck.done()
    finally:
        await listener.close()
    with pytest.raises(asyncio.CancelledError):  # let go at close, not left pending
        await stuck


async def test_an_answer_its_reader_does_not_read_is_dropped_at_the_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scraper that stops reading holds no connection (nor the listener's close) past
    `_ANSWER_TIMEOUT_S`: a large answer is not flushed to it forever."""
    monkeypatch.setattr(probes, "_ANSWER_TIMEOUT_S", 0.3)
    large = b"x" * (64 << 20)

    async def scrape() -> bytes:
        return large

    listener, port = await listening(scrape)
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /metrics HTTP/1.1\r\nhost: probes\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1.0)  # not reading, past the deadline
        received = 0
        try:
            while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
                received += len(chunk)
        except ConnectionResetError:
            pass
        writer.close()
        assert received < len(large)
    finally:
        await asyncio.wait_for(listener.close(), 5)
