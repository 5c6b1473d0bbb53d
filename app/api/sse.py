"""Server-sent events: `data: {json}` frames, the closing `data: [DONE]`, and a response that
streams them and stops (cancelling the producer) as soon as the client disconnects.

Starlette's `StreamingResponse` notices a disconnect only on its next write under newer ASGI
servers, leaving the producer suspended; this response watches `http.disconnect` itself
(`run_until_disconnect`) and closes the producer at once, which cancels the engine requests
behind it. Event loop thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator
from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from app.api.cancellation import ClientDisconnected, run_until_disconnect

DATA = b"data: "  # what every frame starts with
END = b"\n\n"  # and ends with
DONE = DATA + b"[DONE]" + END
MEDIA_TYPE = "text/event-stream"


def event(payload: Any) -> bytes:
    """One `data:` frame (JSON has no raw newlines, so one line suffices)."""
    return DATA + orjson.dumps(payload) + END


class EventStreamResponse(Response):
    def __init__(self, frames: AsyncGenerator[bytes, None]) -> None:
        super().__init__(
            status_code=200,
            media_type=MEDIA_TYPE,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        # Streamed: no Content-Length (the base class sets one for its empty body).
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._frames = frames

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await run_until_disconnect(Request(scope, receive), self._send_frames(send))
        except ClientDisconnected:
            pass  # the producer was closed; nobody is left to answer
        finally:
            await self._frames.aclose()  # a no-op once it finished

    async def _send_frames(self, send: Send) -> None:
        """One write per item of the producer (which may join several frames); the item
        that ends with `[DONE]` also ends the body, saving the empty last write."""
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        more = True
        async with contextlib.aclosing(self._frames) as frames:
            async for frame in frames:
                more = not frame.endswith(DONE)
                await send({"type": "http.response.body", "body": frame, "more_body": more})
        if more:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
