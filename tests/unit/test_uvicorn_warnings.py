"""uvicorn's warnings that any client can cause at will (bytes that are not HTTP, an
`Upgrade: h2c`, a request uvicorn itself finds past the connection cap) are dropped from
the front end's log (`app/api/uvicorn_warnings.py`), summed up in one line a minute at
most; the bytes that are not HTTP are counted as a refusal. Each is caused here through
uvicorn's own protocol, driven with bytes (`tests/unit/test_connection_cap.py`'s
harness), so a change of uvicorn's wording fails these tests instead of passing silently."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from app.api.refusal_budget import RefusalBudget
from app.api.shedding_protocol import shedding_protocol
from app.api.uvicorn_warnings import (
    CLIENT_WARNINGS,
    SUMMARY_INTERVAL_S,
    UVICORN_LOGGER,
    ClientWarnings,
    quiet_client_warnings,
)
from tests.support.fake_transport import FakeTransport
from tests.unit.test_connection_cap import CAP, POST_INFER, CappedService, _app, until_answered

# A TLS ClientHello's first bytes, as a client speaking HTTPS to the plaintext port sends.
TLS_HELLO = b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(32)
H2C_UPGRADE = (
    b"GET /healthz HTTP/1.1\r\nhost: test\r\nconnection: Upgrade, HTTP2-Settings\r\n"
    b"upgrade: h2c\r\nhttp2-settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n"
)


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def uvicorn_log() -> Iterator[Kept]:
    """What reaches uvicorn's logger's handlers (uvicorn's loggers need not propagate),
    from a logger as uvicorn leaves it: without the filter a front end's configuration (or
    an earlier test building one: `cli.uvicorn_config`) installs, and enabled."""
    logger = logging.getLogger(UVICORN_LOGGER)
    kept, level, filters, disabled = Kept(), logger.level, list(logger.filters), logger.disabled
    logger.filters[:] = []
    logger.disabled = False
    logger.addHandler(kept)
    yield kept
    logger.removeHandler(kept)
    logger.setLevel(level)
    logger.filters[:] = filters
    logger.disabled = disabled


def connect(
    service: CappedService,
    state: ServerState,
    loop: asyncio.AbstractEventLoop,
    level: str = "warning",
) -> tuple[Any, FakeTransport]:
    """A new connection to a front end whose connection cap is CAP, as
    `test_connection_cap.connect`, but configured as a front end configures uvicorn's
    logging (`cli.uvicorn_config`): its default configuration removes the logger's handlers."""
    protocol_class = shedding_protocol(
        service,  # type: ignore[arg-type]
        {"/infer": None},
        read_pause_s=1.0,
        budget=RefusalBudget(0),
        body_read_timeout_s=5.0,
    )
    config = uvicorn.Config(
        _app, lifespan="off", log_config=None, log_level=level, limit_concurrency=CAP
    )
    protocol = protocol_class(  # type: ignore[call-arg]
        config=config, server_state=state, app_state={}, _loop=loop
    )
    transport = FakeTransport(("203.0.113.9", 40000))
    protocol.connection_made(transport)  # type: ignore[arg-type]
    return protocol, transport


def cause_each_warning(service: CappedService, level: str = "warning") -> list[FakeTransport]:
    """Bytes that are not HTTP, an h2c upgrade, and a request pipelined past the cap (which
    the protocol leaves to uvicorn's own check), each on a connection of its own."""

    async def clients() -> list[FakeTransport]:
        loop = asyncio.get_running_loop()
        transports = []
        for sent in (TLS_HELLO, H2C_UPGRADE):  # each alone on its server, under the cap
            state = ServerState()
            client, transport = connect(service, state, loop, level)
            client.data_received(sent)
            await until_answered(state)
            transports.append(transport)
        state = ServerState()
        pipelining, pipelined = connect(service, state, loop, level)
        pipelining.data_received(b"GET /first HTTP/1.1\r\nhost: test\r\n\r\n")  # under the cap
        connect(service, state, loop, level)  # another client fills the cap meanwhile
        pipelining.data_received(POST_INFER)  # behind the unanswered first request
        await until_answered(state)
        return [*transports, pipelined]

    return asyncio.run(clients())


def test_uvicorn_says_each_warning_in_the_words_the_filter_knows(uvicorn_log: Kept) -> None:
    cause_each_warning(CappedService())
    said = [record.getMessage() for record in uvicorn_log.records]
    assert said == list(CLIENT_WARNINGS)
    assert all(record.levelno == logging.WARNING for record in uvicorn_log.records)


def test_the_warnings_are_dropped_and_summed_up_once(
    uvicorn_log: Kept, caplog: pytest.LogCaptureFixture
) -> None:
    service = CappedService()
    clock = [0.0]
    quiet_client_warnings(clock=lambda: clock[0])
    with caplog.at_level(logging.INFO, logger="app.api.uvicorn_warnings"):
        tls, h2c, pipelined = cause_each_warning(service)
        cause_each_warning(service)  # a second client of each, within the minute
        clock[0] += SUMMARY_INTERVAL_S
        cause_each_warning(service)
    assert uvicorn_log.records == []
    summaries = [r.getMessage() for r in caplog.records if r.name == "app.api.uvicorn_warnings"]
    assert len(summaries) == 2, summaries
    assert summaries[0].endswith(": 1 invalid_http")  # the first at once
    assert summaries[1].endswith(": 2 connection_cap, 2 invalid_http, 2 unsupported_upgrade")
    # Each was still answered as before: 400, served, refused at the cap.
    assert tls.written.startswith(b"HTTP/1.1 400 ") and tls.closing
    assert h2c.written.startswith(b"HTTP/1.1 200 ")
    assert b"HTTP/1.1 429 " in pipelined.written


def test_bytes_that_are_not_http_are_counted_as_a_refusal(uvicorn_log: Kept) -> None:
    """Counted by the protocol that answers them, whatever the log level lets through."""
    service = CappedService()
    cause_each_warning(service, level="critical")  # uvicorn logs no warning at all
    assert uvicorn_log.records == []
    refused = service.metrics.registry.get_sample_value(
        "steadyserve_rejected_total", {"model": "", "reason": "invalid_http"}
    )
    assert refused == 1
    assert service.drain.count >= 1  # a request arrived, as for the protocol's other refusals


def test_installing_it_again_replaces_the_filter(uvicorn_log: Kept) -> None:
    first = quiet_client_warnings()
    second = quiet_client_warnings()
    filters = logging.getLogger(UVICORN_LOGGER).filters
    assert second in filters and first not in filters
    assert sum(isinstance(f, ClientWarnings) for f in filters) == 1


def test_other_lines_of_uvicorn_pass() -> None:
    quiet = ClientWarnings()
    record = logging.LogRecord(UVICORN_LOGGER, logging.INFO, "", 0, "Started server", (), None)
    assert quiet.filter(record)


def test_a_parse_error_in_a_body_handed_on_is_not_counted_as_a_refusal() -> None:
    """The request was already admitted and handed to the app: counted as such, not twice."""
    service = CappedService()
    state = ServerState()

    async def broken_body() -> None:
        client, _ = connect(service, state, asyncio.get_running_loop())
        client.data_received(
            b"POST /first HTTP/1.1\r\nhost: test\r\ntransfer-encoding: chunked\r\n\r\nzz\r\n"
        )
        await until_answered(state)

    asyncio.run(broken_body())
    refused = service.metrics.registry.get_sample_value(
        "steadyserve_rejected_total", {"model": "", "reason": "invalid_http"}
    )
    assert refused is None
