"""Which refused connections the HTTP protocol pauses (`app/api/shedding_protocol.py`): a proxy's
connection is never paused, and a connection is a proxy's only when its peer is a trusted
proxy (`STEADY_TRUSTED_PROXIES`) and the request carries a proxy's header. The protocol is
driven with bytes through a fake transport and a fake loop: no socket, no clock."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from app.admission import Rejected, RejectReason
from app.api.proxies import came_through_a_proxy, trusted_networks
from app.api.refusal_budget import RefusalBudget
from app.api.shedding_protocol import shedding_protocol
from app.metrics import Metrics
from tests.support.fake_transport import FakeTransport

ENVOY_HEADERS = [(b"x-forwarded-for", b"203.0.113.9"), (b"x-envoy-attempt-count", b"1")]
PRIVATE = trusted_networks(["10.0.0.0/8", "fc00::/7"])


@pytest.mark.parametrize(
    ("peer", "headers", "trusted", "proxied"),
    [
        ("10.1.2.3", ENVOY_HEADERS, PRIVATE, True),
        ("fd00::7", [(b"via", b"1.1 envoy")], PRIVATE, True),
        ("::ffff:10.1.2.3", ENVOY_HEADERS, PRIVATE, True),  # IPv4 on a dual-stack socket
        ("203.0.113.9", ENVOY_HEADERS, PRIVATE, False),  # any client can send the headers
        ("203.0.113.9", [(b"via", b"1.1 fake")], PRIVATE, False),
        ("10.1.2.3", [(b"via", b"1.1 fake")], (), False),  # the default: no peer is trusted
        ("10.1.2.3", [(b"content-type", b"application/json")], PRIVATE, False),
        (None, ENVOY_HEADERS, PRIVATE, False),  # a Unix socket
    ],
)
def test_a_proxy_is_a_trusted_peer_that_sends_proxy_headers(
    peer: str | None, headers: list[tuple[bytes, bytes]], trusted: Any, proxied: bool
) -> None:
    assert came_through_a_proxy(peer, headers, trusted) is proxied


class FakeHandle:
    def cancel(self) -> None:
        pass


@dataclass
class FakeLoop:
    """Records what the protocol schedules (the end of a pause, the keep-alive timer)."""

    scheduled: list[tuple[float, Any]] = field(default_factory=list)

    def call_later(self, delay: float, callback: Any, *args: Any) -> FakeHandle:
        self.scheduled.append((delay, callback))
        return FakeHandle()


class RefusingService:
    """What the protocol asks of a `Service` that refuses everything (in-flight cap full)."""

    def __init__(self) -> None:
        self.admission = type("Admission", (), {"draining": False})()
        self.metrics = Metrics()

    def shed(self, envoy_timeout_ms: float | None, task: str | None = None) -> Rejected:
        return Rejected(RejectReason.INFLIGHT, "full", retry_after_s=1.0)


async def _app(scope: Any, receive: Any, send: Any) -> None:
    raise AssertionError("a refused request never reaches the app")


def refused_connection(peer: str, extra_headers: bytes, trusted: list[str]) -> FakeTransport:
    """One refused POST /infer from `peer`; the connection's transport afterwards."""
    protocol_class = shedding_protocol(
        RefusingService(),  # type: ignore[arg-type]
        {"/infer": None},
        read_pause_s=1.0,
        budget=RefusalBudget(0),  # no refusal is paid for: each may pause its connection
        trusted_proxies=trusted,
        body_read_timeout_s=5.0,
    )
    config = uvicorn.Config(_app, lifespan="off", log_level="warning")
    protocol = protocol_class(  # type: ignore[call-arg]
        config=config, server_state=ServerState(), app_state={}, _loop=FakeLoop()
    )
    transport = FakeTransport((peer, 40000))
    protocol.connection_made(transport)  # type: ignore[arg-type]
    body = b'{"inputs": "x"}'
    protocol.data_received(
        b"POST /infer HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        + extra_headers
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    assert transport.written.startswith(b"HTTP/1.1 429 ")
    return transport


def test_a_direct_client_sending_proxy_headers_is_still_paused() -> None:
    via = b"via: 1.1 not-really-a-proxy\r\nx-forwarded-for: 10.0.0.7\r\n"
    transport = refused_connection("203.0.113.9", via, ["10.0.0.0/8"])
    assert not transport.reading


def test_a_direct_client_is_paused_when_no_proxy_is_trusted() -> None:
    transport = refused_connection("10.1.2.3", b"via: 1.1 envoy\r\n", [])
    assert not transport.reading


def test_a_trusted_proxy_is_never_paused() -> None:
    envoy = b"x-forwarded-for: 203.0.113.9\r\nx-envoy-attempt-count: 1\r\n"
    transport = refused_connection("10.1.2.3", envoy, ["10.0.0.0/8"])
    assert transport.reading


def test_a_trusted_peer_without_proxy_headers_is_paused() -> None:
    transport = refused_connection("10.1.2.3", b"", ["10.0.0.0/8"])
    assert not transport.reading
