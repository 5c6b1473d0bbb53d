"""A stub HTTP/1.1 server that answers every request with a fixed status after a fixed delay.

Two uses: measuring the generator's own ceiling (the stub costs far less per request than
any real server, so the generator is what saturates), and tests that need a server whose
behaviour they control (slow, failing, rejecting with Retry-After).

``python -m loadtest.stub_server --port 9000 [--delay-ms 0] [--status 200]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import cast

from loadtest.driver import run_event_loop

_REASONS = {200: "OK", 429: "Too Many Requests", 500: "Internal Server Error", 503: "Unavailable"}


@dataclass(frozen=True, slots=True)
class StubBehaviour:
    status: int = 200
    delay_s: float = 0.0
    body: bytes = b'{"model":"stub","outputs":[[0.0]],"usage":{}}'
    retry_after_s: int | None = None

    def response_bytes(self) -> bytes:
        head = [
            f"HTTP/1.1 {self.status} {_REASONS.get(self.status, 'Status')}",
            "Content-Type: application/json",
            f"Content-Length: {len(self.body)}",
        ]
        if self.retry_after_s is not None:
            head.append(f"Retry-After: {self.retry_after_s}")
        return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + self.body


class _StubProtocol(asyncio.Protocol):
    """Reads requests framed by Content-Length and answers each in order."""

    def __init__(self, server: StubServer) -> None:
        self._server = server
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's.
        self._transport = cast(asyncio.Transport, transport)
        self._server.transports.add(self._transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._server.transports.discard(self._transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self._buffer[:head_end]).lower()
            length = 0
            marker = head.find(b"\r\ncontent-length:")
            if marker >= 0:
                line_end = head.find(b"\r\n", marker + 2)
                value = head[marker + 17 : line_end if line_end >= 0 else len(head)]
                length = int(value.strip())
            end = head_end + 4 + length
            if len(self._buffer) < end:
                return
            del self._buffer[:end]
            self._server.requests += 1
            self._answer()

    def _answer(self) -> None:
        behaviour = self._server.behaviour
        if behaviour.delay_s > 0:
            asyncio.get_running_loop().call_later(behaviour.delay_s, self._write)
        else:
            self._write()

    def _write(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(self._server.response)


class StubServer:
    """Serve with ``async with StubServer(behaviour).serving() as port``; loopback only."""

    def __init__(self, behaviour: StubBehaviour | None = None) -> None:
        self.behaviour = behaviour or StubBehaviour()
        self.response = self.behaviour.response_bytes()
        self.requests = 0
        self.transports: set[asyncio.Transport] = set()

    @contextlib.asynccontextmanager
    async def serving(self, port: int = 0) -> AsyncIterator[int]:
        loop = asyncio.get_running_loop()
        # A deep accept backlog: a generator opening hundreds of connections at once would
        # otherwise overflow the default (100) and see 1 s SYN retransmits as latency.
        server = await loop.create_server(
            lambda: _StubProtocol(self), "127.0.0.1", port, backlog=4096
        )
        try:
            yield int(server.sockets[0].getsockname()[1])
        finally:
            server.close()
            for transport in list(self.transports):
                transport.abort()
            await server.wait_closed()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--status", type=int, default=200)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--retry-after", type=int)
    options = parser.parse_args(argv)
    behaviour = StubBehaviour(
        options.status, options.delay_ms / 1000.0, retry_after_s=options.retry_after
    )

    async def serve_forever() -> None:
        async with StubServer(behaviour).serving(options.port) as port:
            print(f"stub server on http://127.0.0.1:{port}/ ({behaviour.status})", flush=True)
            await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        run_event_loop(serve_forever)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
