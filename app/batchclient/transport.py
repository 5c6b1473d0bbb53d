"""Keep-alive connections to one server, for the batch client.

Built on ``loadtest.httpclient`` (asyncio protocols, pre-encoded requests) rather than
httpx: measured against a stub answering at once, httpx cost the client ~2 ms of CPU per
request (its pool scans every connection per request, and httpcore retries a failing
``import sniffio`` on each one), which on a 2-core machine takes CPU from the server it
is pacing. One request per connection at a time; connections are opened on demand, so
there are never more than the requests in flight. The event loop's thread only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

from loadtest.httpclient import HttpConnection, RequestError, Response, Target

__all__ = ["ConnectionPool", "RequestError", "Response"]


# steadyserve stops reading a refused connection for at most its refused_read_pause_s (1 s
# by default); a longer Retry-After (a proxy's hour) would only pile idle sockets up.
MAX_REST_S = 5.0


class ConnectionPool:
    def __init__(
        self,
        url: str,
        headers: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.target = Target.parse(url)
        self._headers = dict(headers or {})
        self._idle: list[HttpConnection] = []
        # Connections answered with a Retry-After, and when they may carry a request again:
        # steadyserve stops reading a refused keep-alive connection that long, so a request
        # written into it waits out the pause instead of going on a fresh connection.
        self._resting: list[tuple[float, HttpConnection]] = []
        self._clock = clock

    def _wake_rested(self) -> None:
        now = self._clock()
        rested = [connection for until, connection in self._resting if until <= now]
        if rested:
            self._resting = [(until, c) for until, c in self._resting if until > now]
            self._idle.extend(rested)

    async def post(self, body: bytes, timeout_s: float) -> Response:
        """POST ``body`` (JSON); raises ``RequestError`` when no HTTP response came."""
        self._wake_rested()
        connection = None
        while self._idle and connection is None:
            candidate = self._idle.pop()
            if candidate.usable:  # the server may have closed it while it was idle
                connection = candidate
        if connection is None:
            connection = await HttpConnection.open(self.target, timeout_s, keep_body=True)
        payload = self.target.post_bytes(body, self._headers)
        try:
            response = await connection.request(payload, timeout_s)
        except BaseException:
            connection.close()
            raise
        if connection.usable:
            if response.retry_after_s:
                rest_s = min(response.retry_after_s, MAX_REST_S)
                self._resting.append((self._clock() + rest_s, connection))
            else:
                self._idle.append(connection)
        return response

    def close(self) -> None:
        for connection in [*self._idle, *(c for _, c in self._resting)]:
            connection.close()
        self._idle.clear()
        self._resting.clear()
