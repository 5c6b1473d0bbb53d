"""A second SIGINT: the batch command stops at once, and its summary counts only the lines
whose answers it wrote. Against a loopback server in the test's own event loop; the
signals are real (sent to this process, handled by the command's handlers)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from pathlib import Path

import orjson

from app.batchclient.cli import parse_arguments, run_job

ANSWER = b'{"outputs": [[0.5]]}'
REFUSED = b'{"error": {"type": "too_large", "message": "pack refused"}}'


def _response(status: int, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


async def test_a_second_sigint_counts_only_the_lines_written(tmp_path: Path) -> None:
    """A pack refused (413) is resent one line per request; "a" is answered, "slow" never
    is. Two SIGINTs while "slow" is in flight drop it and the pack with it: "a"'s answer
    is not written, yet the summary said lines_ok 1 (and one line fewer unfinished)."""
    slow_in_flight = asyncio.Event()
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                inputs = orjson.loads(await reader.readexactly(length))["inputs"]
                if isinstance(inputs, list):
                    writer.write(_response(413, REFUSED))
                elif inputs == "slow":
                    slow_in_flight.set()
                    await release.wait()
                    break
                else:
                    writer.write(_response(200, ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"id": "a", "inputs": "a"}\n{"id": "s", "inputs": "slow"}\n')
    out = tmp_path / "out.jsonl"
    summary_path = tmp_path / "summary.json"
    command = [str(source), "--url", f"http://127.0.0.1:{port}", "--out", str(out)]
    command += ["--inputs-per-request", "2", "--progress", "off"]
    args = parse_arguments([*command, "--summary-json", str(summary_path)])

    async def interrupt_twice() -> None:
        await slow_in_flight.wait()
        os.kill(os.getpid(), signal.SIGINT)  # handled before kill returns: one each
        os.kill(os.getpid(), signal.SIGINT)

    interrupter = asyncio.create_task(interrupt_twice())
    async with server:
        try:
            # Prompt: the second signal drops what is in flight, so this does not wait
            # for the server (which never answers "slow"); the bound only keeps a
            # regression from hanging the suite.
            status = await asyncio.wait_for(run_job(args, io.StringIO()), timeout=30.0)
        finally:
            release.set()
            await interrupter
    assert status == 128 + signal.SIGINT
    written = out.read_bytes().splitlines() if out.exists() else []
    summary = orjson.loads(summary_path.read_bytes())
    assert summary["stopped_by"] == "SIGINT"
    assert summary["lines_ok"] == len(written)
    assert summary["lines_failed"] == 0
    assert summary["lines_unfinished"] == 2 - len(written)
