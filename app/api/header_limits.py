"""uvicorn's httptools protocol with limits on what arrives before a request's headers end.

uvicorn bounds none of it: its keep-alive timer is armed only after an answer and cancelled
by the next byte, it builds the URL by concatenation (`self.url += url`) and httptools each
header name and value, so a client could hold a connection (a place under
`max_connections`) forever by sending part of a request, or nothing, and stall the event
loop for seconds (quadratic copying) sending a URL or header of megabytes without a line
end. The shipped Envoy bounds both (`request_headers_timeout`, `max_request_headers_kb`);
a front end reached directly (the image binds 0.0.0.0) had nothing. So (the limits of a
front end, docs/ARCHITECTURE.md §4):

- A connection is idle from its opening as after an answer: one that sends nothing within
  uvicorn's keep-alive timeout (`STEADY_KEEP_ALIVE_TIMEOUT_S`) is closed.
- From a request's first byte (anything an idle connection sends) its headers must have
  ended within `header_timeout_s` (10 s: the shipped Envoy's `request_headers_timeout`),
  or it is answered 408 `header_timeout` (bytes that began no request: closed unanswered).
  Time the server is not reading (a pause, a pipelined request's wait) or an earlier
  request's answer is still to come does not count against the client.
- A request line and headers over `max_header_bytes` (64 KiB: above the 60 KiB Envoy
  forwards, with room for the headers it adds) are answered 431 `headers_too_large`, as
  soon as the reads that brought them are over it: a line that never ends is cut once the
  read it began in, 64 KiB and one more read have arrived (at most ~576 KiB). So are
  headers that span over `max_header_reads` reads (1,024): each read copies the URL or
  header value so far, so a client sending a byte at a time made ~64 KiB squared of
  copying within the cap; the cap bounds that copying, it does not remove it.

Either answer, in the envelope of the request's path (as far as it arrived) like the other
prebuilt refusals (`api/shedding.py`), closes its connection gently: half-closed after the
answer, input dropped unparsed until the client closes or `linger_s` passes; behind an
earlier request whose answer is still to come (pipelined), it waits for that answer and
the input is dropped meanwhile. Each is counted (`_count_head_refusal`), and so is
uvicorn's own 400 to bytes that do not parse as HTTP before a request's headers end
(`invalid_http`: its warning is dropped from the log, `api/uvicorn_warnings.py`).

Its transport is a `StallLimitedTransport` (`api/write_stall.py`): a client that takes
nothing more of its answer for `write_stall_s` (30 s), while the writes are paused or once
the connection closes with bytes still buffered, has its connection aborted, counted
(`_count_write_stall`).

The cost on the way of a request whose headers arrive in one read is a few attribute
stores: no timer, no allocation. Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
from functools import lru_cache
from http import HTTPStatus
from typing import cast

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from app.api.shedding import envelope_of, error_body
from app.api.write_stall import WRITE_STALL_S, StallLimitedTransport

# The shipped Envoy's `request_headers_timeout` (deploy/envoy/envoy.yaml).
HEADER_TIMEOUT_S = 10.0
# Envoy's `max_request_headers_kb` (60 KiB, its default) plus room for what Envoy adds
# (x-forwarded-for, x-request-id, x-envoy-*): a request Envoy forwards is never refused here.
MAX_HEADER_BYTES = 64 * 1024
# Reads one request's headers may span: far above any real client's (a few), far below the
# 65,536 one-byte reads that fit the byte cap.
MAX_HEADER_READS = 1024
HEADER_TIMEOUT, HEADERS_TOO_LARGE = "header_timeout", "headers_too_large"
# Bytes that do not parse as HTTP, before a request was handed on: uvicorn's 400.
INVALID_HTTP = "invalid_http"


@lru_cache(maxsize=16)
def header_refusal(status: int, message: str, envelope: str) -> tuple[bytes, bytes]:
    """The 408 `header_timeout` or 431 `headers_too_large` saying `message`, as HTTP/1.1
    bytes: status line with its fixed headers (`Connection: close`), and JSON body in
    `envelope` (`shedding.envelope_of`)."""
    reason = HEADER_TIMEOUT if status == 408 else HEADERS_TOO_LARGE
    body = error_body(envelope, status, reason, message)
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n"
    )
    return head.encode(), body


def default_headers(server_state: ServerState) -> bytes:
    """uvicorn's default headers (server, date) as lines, for a refusal written as bytes."""
    return b"".join(name + b": " + value + b"\r\n" for name, value in server_state.default_headers)


class HeaderLimitedProtocol(HttpToolsProtocol):
    """The limits of the module's docstring; a subclass sets the class attributes and
    overrides `_on_headers`, not `on_headers_complete`, to see headers within them."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_header_bytes = MAX_HEADER_BYTES
    max_header_reads = MAX_HEADER_READS
    linger_s = 5.0  # a refused connection's input is dropped for at most this long
    write_stall_s = WRITE_STALL_S  # a client that takes no more of its answer: cut off

    # True from a request's first byte to the end of its message; `_in_headers`: to the end
    # of its headers.
    _in_message = False
    _in_headers = False
    # The header timeout, then (refused) the end of the linger.
    _header_deadline: asyncio.TimerHandle | None = None
    # Lengths of the read being parsed, of the read the request began in, and of all the
    # reads its headers have spanned (whole: the first and last also hold other bytes).
    _read_len = 0
    _first_read = 0
    _header_reads = 0
    _header_read_count = 0  # reads the headers have spanned
    # Answered 408/431: nothing more is parsed.
    _refused_head = False
    # Refused behind an earlier request whose answer is still to come: its status, written
    # once that answer is (`on_response_complete`).
    _deferred_refusal = 0
    _refusal_message = ""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's
        # Every use of the transport, uvicorn's included, goes through the stall limit.
        self._stall = StallLimitedTransport(
            transport, self.loop, self.write_stall_s, self._count_write_stall
        )
        super().connection_made(cast(asyncio.Transport, self._stall))
        # Idle, as after an answer: the first byte cancels it (uvicorn's `data_received`).
        self.timeout_keep_alive_task = self.loop.call_later(
            self.timeout_keep_alive, self.timeout_keep_alive_handler
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._stall.lost()
        self._cancel_header_deadline()
        self._unset_keepalive_if_required()  # uvicorn leaves it after a reset
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stall.writing_paused()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stall.writing_resumed()

    def eof_received(self) -> None:
        super().eof_received()  # None: the transport closes itself, its buffer emptied first
        self._stall.closing()

    def data_received(self, data: bytes) -> None:
        if self._refused_head:
            return
        self._read_len = length = len(data)
        if self._in_headers:
            self._header_reads += length
            self._header_read_count += 1
        super().data_received(data)
        if self._refused_head:
            return
        if self._in_headers:
            # Every read after the first is the request's own: over the cap already?
            if self._header_reads - self._first_read > self.max_header_bytes:
                self._refuse_head(431)
                return
            if self._header_read_count > self.max_header_reads:
                self._refuse_head(431, too_many_reads=True)
                return
        elif self._in_message or self.timeout_keep_alive_task is not None or not self._answered():
            return  # a body, an idle connection under keep-alive, or an answer still to come
        # Headers still arriving, or bytes that began no request on an idle connection.
        if self._header_deadline is None and not self.transport.is_closing():
            self._header_deadline = self.loop.call_later(
                self.header_timeout_s, self._header_deadline_passed
            )

    def on_message_begin(self) -> None:
        self._in_message = self._in_headers = True
        self._header_reads = self._first_read = self._read_len
        self._header_read_count = 1
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._in_headers = False
        if self._refused_head:  # a request pipelined after the refused one: dropped
            return
        self._cancel_header_deadline()
        if (
            self._header_reads > self.max_header_bytes
            and self._header_bytes() > self.max_header_bytes
        ):
            self._refuse_head(431)
            return
        self._on_headers()

    def _on_headers(self) -> None:
        """The request's headers, within the limits, are parsed."""
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a parse error; within a body, the request was handed on.
        if self._in_headers or not self._in_message:
            self._count_head_refusal(INVALID_HTTP)
        super().send_400_response(msg)

    def on_body(self, body: bytes) -> None:
        if not self._refused_head:
            super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if not self._refused_head:
            super().on_message_complete()

    def _header_bytes(self) -> int:
        """The request line and headers as sent (less the blanks the parser strips)."""
        size = len(self.parser.get_method()) + len(self.url) + 14  # " ", " HTTP/1.1\r\n", "\r\n"
        for name, value in self.headers:
            size += len(name) + len(value) + 4  # ": ", CRLF
        return size

    def _answered(self) -> bool:
        """No earlier request's answer is still to come."""
        return self.cycle is None or self.cycle.response_complete

    def _may_answer(self) -> bool:
        """Whether a refusal of the request being read may be written now (a subclass that
        half-closes connections says no once it has)."""
        return self._answered()

    def _header_deadline_passed(self) -> None:
        self._header_deadline = None
        if self.transport.is_closing() or self._refused_head:
            return
        if self.flow.read_paused or not self._answered():
            # Not the client's delay: what it sent is not being read, or an earlier answer
            # is still to come (a 408 must not overtake it). Wait on.
            self._header_deadline = self.loop.call_later(
                self.header_timeout_s, self._header_deadline_passed
            )
        elif self._in_headers:
            self._refuse_head(408)
        else:
            self.transport.close()  # only blank lines: no request to answer

    def _refuse_head(self, status: int, too_many_reads: bool = False) -> None:
        """Answer 408/431 and close the connection gently: half-closed, its input dropped
        unparsed until the client closes or `linger_s` passes; behind an earlier answer
        still to come, once it is written (`on_response_complete`); where no answer may be
        written (a half-closed connection), close it."""
        self._cancel_header_deadline()
        if not self._refused_head:
            self._count_head_refusal(HEADER_TIMEOUT if status == 408 else HEADERS_TOO_LARGE)
        self._refused_head = True
        transport = self.transport
        if transport.is_closing():
            return
        if not self._answered():
            self._deferred_refusal = status  # a refusal must not overtake that answer
            self._refusal_message = self._head_refusal_message(status, too_many_reads)
            return
        if not self._may_answer():
            transport.close()
            return
        self._unset_keepalive_if_required()
        try:
            path = (httptools.parse_url(self.url).path or b"/").decode("latin-1")
        except httptools.HttpParserInvalidURLError:
            path = ""  # no path arrived: the project's own envelope
        message = self._refusal_message or self._head_refusal_message(status, too_many_reads)
        head, body = header_refusal(status, message, envelope_of(path))
        transport.write(head + default_headers(self.server_state) + b"\r\n" + body)
        if transport.can_write_eof():
            transport.write_eof()
        self.flow.resume_reading()  # dropped as it arrives, whatever paused it
        self._header_deadline = self.loop.call_later(self.linger_s, transport.close)

    def _head_refusal_message(self, status: int, too_many_reads: bool) -> str:
        if status == 408:
            return f"request headers not received within {self.header_timeout_s:g} s"
        if too_many_reads:
            return f"request line and headers arrived in over {self.max_header_reads} reads"
        return f"request line and headers exceed {self.max_header_bytes} bytes"

    def _count_head_refusal(self, reason: str) -> None:
        """Count a 408/431 (`reason`); a subclass with metrics does."""

    def _count_write_stall(self) -> None:
        """Count a connection aborted for a client that stopped reading; a subclass with
        metrics does."""

    def on_response_complete(self) -> None:
        super().on_response_complete()
        status, self._deferred_refusal = self._deferred_refusal, 0
        if status:  # the answer it waited for is written: its turn (or it waits on)
            self._refuse_head(status)

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None
