"""Keep-alive connections to one server, for the batch client.

Built on ``loadtest.httpclient`` (asyncio protocols, pre-encoded requests) rather than
httpx: measured against a stub answering at once, httpx cost the client ~2 ms of CPU per
request (its pool scans every connection per request, and httpcore retries a failing
``import sniffio`` on each one), which on a 2-core machine takes CPU from the server it
is pacing. One request per connection at a time; connections are opened on demand, so
there are never more than the requests in flight. The event loop's thread only.
"""

from __future__ import annotations

from collections.abc import Mapping

from loadtest.httpclient import HttpConnection, RequestError, Response, Target

__all__ = ["ConnectionPool", "RequestError", "Response"]


class ConnectionPool:
    def __init__(self, url: str, headers: Mapping[str, str] | None = None) -> None:
        self.target = Target.parse(url)
        self._headers = dict(headers or {})
        self._idle: list[HttpConnection] = []

    async def post(self, body: bytes, timeout_s: float) -> Response:
        """POST ``body`` (JSON); raises ``RequestError`` when no HTTP response came."""
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
            self._idle.append(connection)
        return response

    def close(self) -> None:
        for connection in self._idle:
            connection.close()
        self._idle.clear()
