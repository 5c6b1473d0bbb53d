"""loadtest/httpclient.py's `ConnectionPool` and its `on_chunk` hook, which the generation
bench's waves use: keep-alive connections reused request after request (as the openai
client and Envoy's upstream pool reuse them), each body piece handed over as it arrives."""

from __future__ import annotations

import asyncio

from loadtest.httpclient import ConnectionPool, Target

CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"4\r\nwiki\r\n5;ext=1\r\npedia\r\n0\r\n\r\n"
)
FRAMED = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nwhole"
CLOSING = b"HTTP/1.1 503 Unavailable\r\nConnection: close\r\nContent-Length: 8\r\n\r\ndraining"


async def _serve(responses: list[bytes]) -> tuple[asyncio.Server, Target, list[int]]:
    """A server answering its requests with `responses` in turn, on whichever connection
    they come; `connections` counts the connections it accepted."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        while responses:
            try:
                await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                break
            response = responses.pop(0)
            writer.write(response)
            await writer.drain()
            if b"connection: close" in response.lower():
                break
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, Target.parse(f"http://127.0.0.1:{port}/v1/completions"), connections


async def test_requests_reuse_one_connection_and_get_each_body_piece_as_it_arrives() -> None:
    server, target, connections = await _serve([CHUNKED, FRAMED])
    async with server:
        pool = ConnectionPool(target)
        pieces: list[bytes] = []
        first = await pool.request(target.post_bytes(b"{}"), 10.0, pieces.append)
        second = await pool.request(target.post_bytes(b"{}"), 10.0, pieces.append)
        pool.close()
    assert (first.status, first.body, second.body) == (200, b"wikipedia", b"whole")
    assert pieces == [b"wiki", b"pedia", b"whole"]
    assert len(connections) == 1


async def test_a_connection_the_server_closes_is_not_reused() -> None:
    server, target, connections = await _serve([CLOSING, FRAMED])
    async with server:
        pool = ConnectionPool(target)
        refused = await pool.request(target.post_bytes(b"{}"), 10.0)
        answered = await pool.request(target.post_bytes(b"{}"), 10.0)
        pool.close()
    assert (refused.status, answered.status, answered.body) == (503, 200, b"whole")
    assert len(connections) == 2


async def test_fill_opens_connections_a_wave_then_finds_open() -> None:
    server, target, connections = await _serve([FRAMED, FRAMED, FRAMED])
    async with server:
        pool = ConnectionPool(target)
        await pool.fill(3)
        answers = await asyncio.gather(
            *(pool.request(target.post_bytes(b"{}"), 10.0) for _ in range(3))
        )
        pool.close()
    assert [answer.body for answer in answers] == [b"whole"] * 3
    assert len(connections) == 3
