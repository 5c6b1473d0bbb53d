"""A minimal HTTP/1.1 keep-alive client on asyncio protocols, built for a load generator.

Why not httpx or aiohttp: at thousands of requests per second on one core, the client's
own cost per request decides whether the generator or the server is being measured. This
client writes pre-encoded request bytes and parses only what a load test needs (status,
Content-Length or chunked framing, Retry-After, Connection: close), with one future and
one timer per request. One request at a time per connection (no pipelining), as browsers,
locust and hey do.
"""

from __future__ import annotations

import asyncio
import datetime
import email.utils
import math
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, cast
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024


class Response(NamedTuple):
    status: int
    retry_after_s: float | None
    body_bytes: int  # on the wire, chunk framing included
    body: bytes = b""  # only from connections opened with keep_body=True; chunks joined


class RequestError(Exception):
    """A request that got no HTTP response; ``kind`` is the error class the report counts."""

    CONNECT = "connect"
    CLOSED = "closed"
    TIMEOUT = "timeout"
    PROTOCOL = "protocol"

    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Target:
    """Where requests go: parsed once from a URL such as ``http://127.0.0.1:8000/infer``."""

    scheme: str
    host: str
    port: int
    path: str

    @classmethod
    def parse(cls, url: str) -> Target:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = parts.path or "/"
        if parts.query:
            path += "?" + parts.query
        return cls(parts.scheme, parts.hostname, port, path)

    @property
    def host_header(self) -> str:
        default_port = 443 if self.scheme == "https" else 80
        return self.host if self.port == default_port else f"{self.host}:{self.port}"

    def post_bytes(self, body: bytes, headers: Mapping[str, str] | None = None) -> bytes:
        """The complete bytes of a POST of ``body`` (JSON) to this target."""
        lines = [
            f"POST {self.path} HTTP/1.1",
            f"Host: {self.host_header}",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
        ]
        lines.extend(f"{name}: {value}" for name, value in (headers or {}).items())
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body

    def get_bytes(self, path: str) -> bytes:
        return f"GET {path} HTTP/1.1\r\nHost: {self.host_header}\r\n\r\n".encode("latin-1")


def _header_value(lowered_head: bytes, name: bytes) -> bytes | None:
    """The value of header ``name`` (lower case, with colon) in a lower-cased response head."""
    start = lowered_head.find(b"\r\n" + name)
    if start < 0:
        return None
    start += 2 + len(name)
    end = lowered_head.find(b"\r\n", start)
    return lowered_head[start : end if end >= 0 else len(lowered_head)].strip()


def retry_after_seconds(value: str, now: float) -> float | None:
    """A Retry-After value as seconds from `now` (wall clock): delay-seconds, or an HTTP
    date (a date already past is 0). None for anything else, a negative or non-finite
    number included: `sleep(nan)` returns at once, so a NaN would be no wait at all."""
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, OverflowError):  # a year or zone out of range
            return None
        if when.tzinfo is None:  # RFC 9110 dates are GMT; one without a zone is read so
            when = when.replace(tzinfo=datetime.UTC)
        return max(0.0, when.timestamp() - now)
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


class _ResponseReader(asyncio.Protocol):
    """Accumulates bytes and resolves the waiting request's future when a response is whole."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep_body: bool = False) -> None:
        self._loop = loop
        self._keep_body = keep_body
        self._buffer = bytearray()
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._waiter: asyncio.Future[Response] | None = None
        self._on_chunk: Callable[[bytes], None] | None = None
        self._reset_response()

    def _reset_response(self) -> None:
        self._head_length = -1
        self._status = 0
        self._retry_after: float | None = None
        self._content_length = -1
        self._chunked = False
        self._close_after = False
        self._chunk_position = 0

    # -- asyncio.Protocol ------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement the interface without subclassing asyncio's.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._waiter is not None:
            self._parse()

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost settles the waiter

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._head_length >= 0 and self._content_length < 0 and not self._chunked:
            # A response framed by closing the connection is complete now.
            self._finish(len(self._buffer))
        else:
            waiter.set_exception(RequestError(RequestError.CLOSED, str(exc or "by server")))
            self._waiter = None

    # -- request side ----------------------------------------------------------------------
    def send(
        self, payload: bytes, on_chunk: Callable[[bytes], None] | None = None
    ) -> asyncio.Future[Response]:
        assert self.transport is not None
        self._waiter = self._loop.create_future()
        self._on_chunk = on_chunk
        self._reset_response()
        self.transport.write(payload)
        return self._waiter

    def fail(self, error: RequestError) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(error)
        self._waiter = None
        self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    # -- parsing ---------------------------------------------------------------------------
    def _parse(self) -> None:
        buffer = self._buffer
        if self._head_length < 0 and not self._parse_head():
            return
        if self._chunked:
            end = self._chunked_end()
            if end >= 0:
                self._finish(end)
        elif self._content_length >= 0:
            end = self._head_length + self._content_length
            if len(buffer) >= end:
                self._finish(end)

    def _parse_head(self) -> bool:
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > MAX_HEAD_BYTES:
                self.fail(RequestError(RequestError.PROTOCOL, "response head too large"))
            return False
        head = bytes(buffer[:end]).lower()
        if not head.startswith(b"http/1.") or len(head) < 12 or not head[9:12].isdigit():
            self.fail(RequestError(RequestError.PROTOCOL, f"bad status line {head[:40]!r}"))
            return False
        self._status = int(head[9:12])
        self._head_length = end + 4
        self._chunk_position = self._head_length
        retry_after = _header_value(head, b"retry-after:")
        if retry_after is not None:
            self._retry_after = retry_after_seconds(retry_after.decode("latin-1"), time.time())
        encoding = _header_value(head, b"transfer-encoding:")
        self._chunked = encoding is not None and b"chunked" in encoding
        length = _header_value(head, b"content-length:")
        if self._status in (204, 304) or 100 <= self._status < 200:
            self._content_length = 0
        elif length is not None and not self._chunked:
            if not length.isdigit():
                self.fail(RequestError(RequestError.PROTOCOL, f"bad content-length {length!r}"))
                return False
            self._content_length = int(length)
        connection = _header_value(head, b"connection:")
        self._close_after = (connection is not None and b"close" in connection) or head.startswith(
            b"http/1.0"
        )
        return True

    def _chunked_end(self) -> int:
        """The offset just past the last chunk, or -1 while the body is incomplete."""
        buffer = self._buffer
        position = self._chunk_position
        while True:
            line_end = buffer.find(b"\r\n", position)
            if line_end < 0:
                return -1
            size = int(bytes(buffer[position:line_end]).split(b";")[0], 16)
            if size == 0:
                trailer_end = buffer.find(b"\r\n\r\n", line_end)
                if buffer[line_end : line_end + 4] == b"\r\n\r\n":
                    return line_end + 4
                return -1 if trailer_end < 0 else trailer_end + 4
            chunk_end = line_end + 2 + size + 2
            if len(buffer) < chunk_end:
                return -1
            if self._on_chunk is not None:
                self._on_chunk(bytes(buffer[line_end + 2 : line_end + 2 + size]))
            position = self._chunk_position = chunk_end

    def _finish(self, end: int) -> None:
        waiter = self._waiter
        self._waiter = None
        body = b""
        if self._keep_body:
            body = bytes(self._buffer[self._head_length : end])
            if self._chunked:
                body = _join_chunks(body)
        if self._on_chunk is not None and not self._chunked and end > self._head_length:
            self._on_chunk(bytes(self._buffer[self._head_length : end]))
        self._on_chunk = None
        response = Response(self._status, self._retry_after, end - self._head_length, body)
        del self._buffer[:end]
        if self._close_after:
            self.abort()
        if waiter is not None and not waiter.done():
            waiter.set_result(response)


def _join_chunks(framed: bytes) -> bytes:
    """The payload of a complete chunked body (size lines, chunks, trailers)."""
    parts: list[bytes] = []
    position = 0
    while True:
        line_end = framed.find(b"\r\n", position)
        size = int(framed[position:line_end].split(b";")[0], 16)
        if size == 0:
            return b"".join(parts)
        start = line_end + 2
        parts.append(framed[start : start + size])
        position = start + size + 2


class HttpConnection:
    """One keep-alive connection; ``request`` may be awaited by one caller at a time."""

    def __init__(self, reader: _ResponseReader, loop: asyncio.AbstractEventLoop) -> None:
        self._reader = reader
        self._loop = loop

    @classmethod
    async def open(
        cls, target: Target, timeout_s: float = 10.0, keep_body: bool = False
    ) -> HttpConnection:
        loop = asyncio.get_running_loop()
        context = ssl.create_default_context() if target.scheme == "https" else None
        try:
            async with asyncio.timeout(timeout_s):
                _, reader = await loop.create_connection(
                    lambda: _ResponseReader(loop, keep_body),
                    target.host,
                    target.port,
                    ssl=context,
                )
        except TimeoutError as error:
            raise RequestError(RequestError.CONNECT, "connect timed out") from error
        except OSError as error:
            raise RequestError(RequestError.CONNECT, str(error)) from error
        return cls(reader, loop)

    @property
    def usable(self) -> bool:
        return not self._reader.closed

    async def request(
        self,
        payload: bytes,
        timeout_s: float,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> Response:
        """Send ``payload`` and wait for the whole response; `on_chunk` is handed each piece
        of its body as it arrives (a chunk's payload; a body framed by its length, whole). On
        a timeout the connection is aborted, because a late response would otherwise be read
        as the next one's."""
        reader = self._reader
        if reader.closed:
            raise RequestError(RequestError.CLOSED, "connection already closed")
        waiter = reader.send(payload, on_chunk)
        timeout = RequestError(RequestError.TIMEOUT, f"no response in {timeout_s}s")
        timer = self._loop.call_later(timeout_s, reader.fail, timeout)
        try:
            return await waiter
        finally:
            timer.cancel()
            if waiter.cancelled():
                # The caller gave up (run ending): the connection's state is unknown.
                reader.abort()

    def close(self) -> None:
        self._reader.abort()


class ConnectionPool:
    """Idle keep-alive connections to one target, as a client library keeps them (httpx,
    the openai client) and Envoy keeps its upstream ones: a request takes an idle one (a new
    one when none is), and gives it back once its response was read whole, unless the
    server closed it. One event loop: make, use and close a pool within one `asyncio.run`."""

    def __init__(self, target: Target, keep_body: bool = True) -> None:
        self.target = target
        self._keep_body = keep_body
        self._idle: list[HttpConnection] = []

    async def _take(self) -> HttpConnection:
        while self._idle:
            connection = self._idle.pop()
            if connection.usable:  # else the server closed it while it sat idle
                return connection
        return await HttpConnection.open(self.target, keep_body=self._keep_body)

    async def fill(self, count: int) -> None:
        """Open connections until `count` are idle (so a wave's requests find theirs open)."""
        self._idle = [connection for connection in self._idle if connection.usable]
        while len(self._idle) < count:
            self._idle.append(await HttpConnection.open(self.target, keep_body=self._keep_body))

    async def request(
        self,
        payload: bytes,
        timeout_s: float,
        on_chunk: Callable[[bytes], None] | None = None,
    ) -> Response:
        """`HttpConnection.request` on a connection of the pool's."""
        connection = await self._take()
        try:
            response = await connection.request(payload, timeout_s, on_chunk)
        except BaseException:
            connection.close()
            raise
        if connection.usable:
            self._idle.append(connection)
        return response

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
