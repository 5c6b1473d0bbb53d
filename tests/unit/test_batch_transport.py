"""The batch client's connection pool against a raw loopback server."""

from __future__ import annotations

import asyncio

from app.batchclient.transport import MAX_REST_S, ConnectionPool

REFUSED = b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 1\r\nContent-Length: 2\r\n\r\n{}"
REFUSED_FOR_AN_HOUR = REFUSED.replace(b"Retry-After: 1", b"Retry-After: 3600")
ANSWERED = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}"


async def test_a_connection_refused_with_retry_after_rests_that_long_before_reuse() -> None:
    # steadyserve stops reading a refused keep-alive connection until its Retry-After has
    # passed: the next request written into it waited out that pause.
    answers = [REFUSED, ANSWERED, ANSWERED, ANSWERED, REFUSED_FOR_AN_HOUR]
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(len(connections))
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            await reader.readexactly(length)
            writer.write(answers.pop(0))
            await writer.drain()
        writer.close()

    now = [0.0]
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = ConnectionPool(f"http://127.0.0.1:{port}/infer", clock=lambda: now[0])
    async with server:
        assert (await pool.post(b"{}", 5.0)).status == 429
        assert (await pool.post(b"{}", 5.0)).status == 200
        assert len(connections) == 2  # not the refused one: it rests
        now[0] = 1.0
        # The one just answered is reused first (most recent), then the rested one.
        first, second = await asyncio.gather(pool.post(b"{}", 5.0), pool.post(b"{}", 5.0))
        assert (first.status, second.status) == (200, 200)
        assert len(connections) == 2
        # A proxy's hour rests no longer than steadyserve's pause could last.
        assert (await pool.post(b"{}", 5.0)).status == 429
        assert [until for until, _ in pool._resting] == [now[0] + MAX_REST_S]
        pool.close()
