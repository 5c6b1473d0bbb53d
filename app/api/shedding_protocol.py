"""uvicorn's httptools protocol with the shedding of `api/shedding.py` built in.

It writes a refusal to the socket as soon as the request's headers are parsed: no asyncio
task, no ASGI scope handed on, no middleware, and the body is discarded as it arrives (for
at most the body read timeout: then the connection is closed). Then, unless admissions have
paid for the refusal (`api/refusal_budget.py`), it stops reading that connection until its
Retry-After has passed (at most `refused_read_pause_s`). Under a closed-loop flood (clients
resending the moment they are refused) refusals are otherwise most of what a front end
does: each refused connection is ready again at once, so every event-loop turn, which
admitted requests wait in, grows with the number of connections (figures:
docs/BENCHMARKS.md, "Refusals in the HTTP protocol"). A client that honours Retry-After
sends nothing during the pause. A connection from a trusted proxy
(`STEADY_TRUSTED_PROXIES`) is never paused: it carries other clients' requests too.

The protocol also answers uvicorn's connection cap (`limit_concurrency`, set from
`max_connections`): past it, uvicorn would answer a plain-text 503 of its own, counted
nowhere, without `Retry-After` or the retry-elsewhere header. Instead every request there
gets the prebuilt 429 `connections`, written from its headers like the refusals above and
counted among them, and its connection is closed: closing is what frees a place. All but
Prometheus's scrape (`GET /metrics`), served past the cap: refused, a flood's metrics were
lost just while it lasted (the probes have a port of their own: `health_port`). A
connection closed while the request's body is still arriving is closed gently (half-closed,
the rest of the body discarded, then closed), or a client still sending would get a reset
in place of the answer. It is a `HeaderLimitedProtocol` (`api/header_limits.py`): a header
deadline, a size cap on the headers, an idle timeout from the connection's opening, and a
limit on how long a client may leave its answer unread (`api/write_stall.py`).

Everything here runs on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Collection, Mapping
from functools import cache
from typing import cast

import httptools
from prometheus_client import Counter
from starlette.types import Receive, Scope, Send
from uvicorn._types import ASGI3Application
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from app.admission import Entry, Rejected, RejectReason
from app.api.common import ENTRY, envoy_timeout_in
from app.api.header_limits import (
    HEADER_TIMEOUT_S,
    MAX_HEADER_BYTES,
    HeaderLimitedProtocol,
    default_headers,
)
from app.api.proxies import came_through_a_proxy, trusted_networks
from app.api.refusal_budget import RefusalBudget
from app.api.shedding import (
    CONNECTION_CAP_REFUSAL,
    envelope_of,
    raw_refusal,
    send_rejection,
    shed_timing,
)
from app.service import Service

# Served past the connection cap: Prometheus's scrape records the flood that fills it.
SCRAPE_METHOD, SCRAPE_PATH = b"GET", b"/metrics"


def is_scrape(method: bytes, raw_path: bytes) -> bool:
    """Whether a request is Prometheus's scrape, by its method and undecoded path (both
    places that let one past the connection cap ask this, so they agree on `/%6Detrics`)."""
    return method == SCRAPE_METHOD and raw_path == SCRAPE_PATH


def shedding_protocol(
    service: Service,
    paths: Mapping[str, str | None],
    read_pause_s: float,
    budget: RefusalBudget,
    trusted_proxies: Collection[str] = (),
    *,
    body_read_timeout_s: float,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    max_header_bytes: int = MAX_HEADER_BYTES,
) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (pass it as `uvicorn.Config(http=...)`), refusing what
    `service.shed` refuses as soon as a request's headers are parsed, and pausing reads of
    a refused connection for its Retry-After, at most `read_pause_s`, when `budget` has no
    refusal to answer at once (admissions earn them) and the connection is not a proxy's
    (one from `trusted_proxies` whose request carries proxy headers). A request it admits
    goes on through the ASGI app with its `Entry` in the scope, so `SheddingMiddleware` must
    wrap that app (it calls `Service.leave`). Past uvicorn's connection cap
    (`Config(limit_concurrency=...)`) every request but `GET /metrics` gets the 429
    `connections` instead of uvicorn's 503; a scrape is served.

    A request answered before its body ended (refused here, or answered early by the app)
    has the rest of its body discarded as it arrives, for at most `body_read_timeout_s`
    after the read that left it unfinished (plus any pause), as the body guard bounds a
    body read; then its connection is closed. uvicorn has no such bound: the read that
    brings the next byte cancels its keep-alive timer, and only the end of an answered
    message's body, which it ignores, would have armed it again.

    A connection closed with its answer (a refusal with `Connection: close`, here or by
    the app) while the request's body is still arriving is closed gently: half-closed
    after the answer (`write_eof`), its input discarded until the message ends, the client
    closes or that same bound passes, then closed. Closing a socket with unread input makes
    Linux reset the connection (RST), and a client still sending its body lost the
    answer.

    A request's headers must end within `header_timeout_s` of its first byte and stay
    within `max_header_bytes`: else 408/431, and the connection closed gently, its input
    dropped for at most `body_read_timeout_s` (`HeaderLimitedProtocol`)."""
    # A private method: pyproject.toml only sets uvicorn's floor (0.45, which added it);
    # constraints-lock.txt pins the version `make` installs, the one the tests passed with.
    if not hasattr(HttpToolsProtocol, "_start_asgi_task"):  # uvicorn < 0.45
        raise RuntimeError("uvicorn >= 0.45 is needed: its connection cap is answered here")
    shed_paths = {path.encode(): task for path, task in paths.items()}
    trusted = trusted_networks(trusted_proxies)

    @cache  # labelled once, at the first refusal: this runs for each request of a flood
    def connection_cap_refusals() -> Counter:
        return service.metrics.rejected.labels("", RejectReason.CONNECTIONS.value)

    def count_connection_cap_refusal() -> None:
        service.drain.arrived()  # a request arrived, as `Service.shed` counts them
        connection_cap_refusals().inc()

    async def refuse_at_connection_cap(scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app uvicorn runs where it would run its own `service_unavailable`."""
        started = time.perf_counter()
        count_connection_cap_refusal()
        await send_rejection(CONNECTION_CAP_REFUSAL, scope["path"], send, started, close=True)

    class SheddingProtocol(HeaderLimitedProtocol):
        # True from a refusal to the end of that request's message: its body is dropped.
        _discarding = False
        # The connection closes once the message being read ends (`_close_gently`):
        # everything read until then is dropped.
        _closing = False
        # The cycle uvicorn made for the message being read (`_in_message`): None for one
        # refused here, or not handed to the app.
        _message_cycle: RequestResponseCycle | None = None
        # Closes the connection if the body of a request answered before its end is still
        # arriving then (`data_received`); the refusal's read pause extends it.
        _discard_deadline: asyncio.TimerHandle | None = None
        _refusal_pause_s = 0.0

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if (
                self._in_message
                and self._discard_deadline is None
                and self._answered_before_its_end()
                and not self.transport.is_closing()
            ):
                self._discard_deadline = self.loop.call_later(
                    body_read_timeout_s + self._refusal_pause_s, self._discard_expired
                )

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # uvicorn's
            super().connection_made(transport)
            # The transport as the requests' cycles see it: where uvicorn closes it after an
            # answer (`Connection: close`), it is closed gently. `self.transport`, the stall
            # limit's (`HeaderLimitedProtocol`): it counts what the answers write.
            self._cycle_transport = cast(
                asyncio.Transport, _ClosingGently(self.transport, self._close_gently)
            )

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_discard_deadline()
            super().connection_lost(exc)

        def _should_upgrade(self) -> bool:
            # Behind a gentle close everything is dropped: an upgrade there was never parsed
            # as a request (no scope), and uvicorn's upgrade of it raised mid-read.
            return not self._closing and super()._should_upgrade()

        def _unsupported_upgrade_warning(self) -> None:
            # A client can repeat it at will: dropped from the log (`api/uvicorn_warnings.py`).
            if not self._closing:  # dropped unserved behind a gentle close: nothing to warn of
                super()._unsupported_upgrade_warning()

        def send_400_response(self, msg: str) -> None:
            if self._closing:  # half-closed: nothing more is written
                self.transport.close()
            else:
                super().send_400_response(msg)

        def on_message_begin(self) -> None:
            self._discarding = self._closing
            self._in_message = True
            self._message_cycle = None
            self._refusal_pause_s = 0.0
            # A refusal completes its response inside the parser (`_send_refusal`), which
            # arms uvicorn's keep-alive timer; a request that begins in the same read means
            # the connection is not idle, and the timer would close it mid-answer.
            self._unset_keepalive_if_required()
            super().on_message_begin()

        def _on_headers(self) -> None:
            if self._closing or self._refused_here():
                return
            before = self.cycle
            super()._on_headers()
            if self.cycle is not before:  # not for an upgrade
                self._message_cycle = self.cycle
                self.cycle.transport = self._cycle_transport

        def on_body(self, body: bytes) -> None:
            if not self._discarding:
                super().on_body(body)

        def on_message_complete(self) -> None:
            answered = self._answered_before_its_end()
            self._in_message = False
            if not self._discarding:
                super().on_message_complete()
            if answered:
                self._discarded()

        def _may_answer(self) -> bool:
            return not self._closing and super()._may_answer()  # half-closed: no more

        def _count_head_refusal(self, reason: str) -> None:
            service.drain.arrived()  # a request arrived, as `Service.shed` counts them
            service.metrics.rejected.labels("", reason).inc()

        def _count_write_stall(self) -> None:
            service.metrics.write_stalls.inc()

        def _answered_before_its_end(self) -> bool:
            """Whether the request being parsed was answered (refused here, or by the app)
            while its body is still arriving: what arrives of it is discarded."""
            cycle = self._message_cycle
            return self._discarding or (cycle is not None and cycle.response_complete)

        def _discarded(self) -> None:
            """The message of a request answered before its end has ended: the connection
            is idle, under uvicorn's keep-alive timer again, armed as its
            `on_response_complete` arms it (the read that brought the rest of the body
            cancelled the one the answer armed)."""
            self._cancel_discard_deadline()
            if self._closing:
                self.transport.close()  # all its input read: a FIN, not a reset
                return
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

        def _discard_expired(self) -> None:
            self._discard_deadline = None
            if self._in_message and not self.transport.is_closing():
                self.transport.close()

        def _close_gently(self) -> None:
            """Close the connection once its answer is written, without a reset: at once
            between messages; while a request's body is still arriving, half-close (the
            client reads the answer and its end), drop what arrives until the message ends
            or the client closes, within the discard deadline, then close."""
            if self._closing or self.transport.is_closing():
                return
            if not self._in_message:
                self.transport.close()
                return
            self._closing = self._discarding = True
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.flow.resume_reading()  # paused while the app had not read the body
            if self._discard_deadline is None:
                self._discard_deadline = self.loop.call_later(
                    body_read_timeout_s, self._discard_expired
                )

        def on_response_complete(self) -> None:
            if not self._closing:
                super().on_response_complete()
                return
            # As uvicorn does for a closed connection: no keep-alive timer, no pipelined
            # request started (the rest of the message is being discarded).
            self.server_state.total_requests += 1
            self.pipeline.clear()

        def _cancel_discard_deadline(self) -> None:
            if self._discard_deadline is not None:
                self._discard_deadline.cancel()
                self._discard_deadline = None

        def _start_asgi_task(self, cycle: RequestResponseCycle, app: ASGI3Application) -> None:
            # uvicorn decided on its connection cap itself (a request pipelined behind an
            # unanswered one, which `_refused_here` leaves to it, an upgrade, or a scrape):
            # the same refusal as written from the headers in place of its plain-text 503,
            # and a scrape served. (Its warning is dropped: `api/uvicorn_warnings.py`.)
            if app is service_unavailable:
                scope = cycle.scope
                # No root path is configured: the raw path is the URL's, as parsed there.
                scrape = is_scrape(scope["method"].encode("ascii"), scope["raw_path"])
                app = self.app if scrape else refuse_at_connection_cap  # type: ignore[assignment]  # starlette's ASGI types
            super()._start_asgi_task(cycle, app)

        def _at_connection_cap(self) -> bool:
            """uvicorn's own test of `limit_concurrency` (its `on_headers_complete`), on its
            own state: this process's connections, or its requests' tasks, at the cap."""
            cap = self.limit_concurrency
            return cap is not None and (len(self.connections) >= cap or len(self.tasks) >= cap)

        def _refused_here(self) -> bool:
            """Shed the request whose headers were just parsed; True once it is answered."""
            if self.parser.should_upgrade():
                return False  # uvicorn's (`_start_asgi_task` still answers its cap)
            if self.cycle is not None and not self.cycle.response_complete:
                # Pipelined behind an unanswered request: answered in order, by the middleware
                # (or, at the cap, by what `_start_asgi_task` puts in uvicorn's 503's place).
                return False
            if self._at_connection_cap():
                # Any method and path but a scrape, as uvicorn refused them: no task, no
                # ASGI, and none of uvicorn's log lines, one per request of the flood.
                path = self._path()
                if is_scrape(self.parser.get_method(), path):
                    return False  # served: `_start_asgi_task` lifts uvicorn's cap for it
                self._send_refusal(CONNECTION_CAP_REFUSAL, path, time.perf_counter(), close=True)
                count_connection_cap_refusal()
                return True
            if self.parser.get_method() != b"POST":
                return False
            path = self._path()
            if path not in shed_paths:
                return False
            started = time.perf_counter()
            entry = service.shed(envoy_timeout_in(self.headers), task=shed_paths[path])
            if isinstance(entry, Entry):
                self.scope[ENTRY] = entry  # type: ignore[literal-required]
                budget.admitted()
                return False
            self._send_refusal(entry, path, started)
            return True

        def _path(self) -> bytes:
            """The parsed request's path; "/" for a proxy's absolute form without one
            (`GET http://host`: None, on which the refusal's envelope failed, a 400)."""
            return httptools.parse_url(self.url).path or b"/"

        def _send_refusal(
            self, rejection: Rejected, path: bytes, started: float, close: bool = False
        ) -> None:
            # `path`: the request's, as `_refused_here` parsed it (its refusal's envelope).
            # A client waiting for 100 Continue will not send the body it declared, so the
            # connection cannot carry another request: it is closed, as while draining, and
            # as `close` asks (at the connection cap: closing is what frees a place).
            keep_alive = (
                not close
                and self.parser.get_http_version() == "1.1"
                and self.parser.should_keep_alive()
                and not self.expect_100_continue
                and not service.admission.draining
            )
            head, body = raw_refusal(
                rejection.reason.value,
                rejection.retry_after_header,
                not keep_alive,
                envelope_of(path.decode("latin-1")),
            )
            timing = b"server-timing: " + shed_timing(started) + b"\r\n\r\n"
            self.transport.write(head + default_headers(self.server_state) + timing + body)
            self._discarding = True
            if not keep_alive:
                self._close_gently()
            self.on_response_complete()
            pause_s = min(rejection.retry_after_whole_s or 0, read_pause_s)
            if (
                keep_alive
                and pause_s > 0
                and not came_through_a_proxy(
                    self.client[0] if self.client else None, self.headers, trusted
                )
                and not budget.answer_at_once()
            ):
                self.flow.pause_reading()
                self.loop.call_later(pause_s, self._resume_after_refusal)
                self._refusal_pause_s = pause_s
                service.metrics.refusals_paused.inc()

        def _resume_after_refusal(self) -> None:
            if not self.transport.is_closing():
                self.flow.resume_reading()

    SheddingProtocol.header_timeout_s = header_timeout_s
    SheddingProtocol.max_header_bytes = max_header_bytes
    SheddingProtocol.linger_s = body_read_timeout_s
    return SheddingProtocol


class _ClosingGently:
    """A transport as uvicorn's request cycle uses it (write, is_closing, close), whose
    `close` is the protocol's gentle close."""

    def __init__(self, transport: asyncio.Transport, close: Callable[[], None]) -> None:
        self.write = transport.write
        self.is_closing = transport.is_closing
        self.close = close
