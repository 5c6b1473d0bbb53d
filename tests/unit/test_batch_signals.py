"""SIGINT during a batch job: a second one stops at once, writing every answer received; a
third, however late, is ignored (it raised KeyboardInterrupt once the handlers were gone,
and the summary was lost). Against a loopback server in the test's own event loop; the
signals are real (sent to this process, handled by the command's handlers)."""

from __future__ import annotations

import asyncio
import io
import os
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import orjson
import pytest

from app.batchclient.cli import parse_arguments, run_job
from app.batchclient.interrupts import Interrupts

ANSWER = b'{"outputs": [[0.5]]}'
REFUSED = b'{"error": {"type": "too_large", "message": "pack refused"}}'
LINES = b'{"id": "a", "inputs": "a"}\n{"id": "s", "inputs": "slow"}\n'


def _response(status: int, body: bytes) -> bytes:
    head = f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


class PackRefusingServer:
    """Refuses any pack (413), so a pack is resent one line per request; answers "slow"
    only once `answer_slow` is set (never, in the first run), any other input at once.
    `sent` holds every request's inputs, in order."""

    def __init__(self) -> None:
        self.sent: list[object] = []
        self.slow_in_flight = asyncio.Event()
        self.answer_slow = False
        self.release = asyncio.Event()  # ends the connection holding an unanswered "slow"
        self.port = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                inputs = orjson.loads(await reader.readexactly(length))["inputs"]
                self.sent.append(inputs)
                if isinstance(inputs, list):
                    writer.write(_response(413, REFUSED))
                elif inputs == "slow" and not self.answer_slow:
                    self.slow_in_flight.set()
                    await self.release.wait()
                    break
                else:
                    writer.write(_response(200, ANSWER))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    @asynccontextmanager
    async def running(self) -> AsyncIterator[PackRefusingServer]:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        async with server:
            try:
                yield self
            finally:
                self.release.set()


def _job(tmp_path: Path, port: int) -> list[str]:
    source = tmp_path / "in.jsonl"
    source.write_bytes(LINES)
    command = [str(source), "--url", f"http://127.0.0.1:{port}", "--out"]
    command += [str(tmp_path / "out.jsonl"), "--inputs-per-request", "2", "--progress", "off"]
    return [*command, "--summary-json", str(tmp_path / "summary.json")]


async def _interrupt_twice(server: PackRefusingServer) -> None:
    await server.slow_in_flight.wait()
    os.kill(os.getpid(), signal.SIGINT)  # handled before kill returns: one each
    os.kill(os.getpid(), signal.SIGINT)


def _written_ids(tmp_path: Path) -> list[object]:
    out = tmp_path / "out.jsonl"
    lines = out.read_bytes().splitlines() if out.exists() else []
    return [orjson.loads(line)["id"] for line in lines]


async def test_a_second_sigint_writes_the_answers_received_and_a_rerun_skips_them(
    tmp_path: Path,
) -> None:
    """The pack ["a", "slow"] is refused and resent one line at a time; "a" is answered,
    "slow" never is. Two SIGINTs while "slow" is in flight dropped the whole pack, "a"'s
    answer with it: not written, so the rerun sent "a" again."""
    async with PackRefusingServer().running() as server:
        args = parse_arguments(_job(tmp_path, server.port))
        interrupter = asyncio.create_task(_interrupt_twice(server))
        # Prompt: the second signal drops what is in flight, so this does not wait for the
        # server (which never answers "slow"); the bound only keeps a regression from
        # hanging the suite.
        async with asyncio.timeout(30.0):
            status = await run_job(args, io.StringIO())
        await interrupter
        assert status == 128 + signal.SIGINT
        assert _written_ids(tmp_path) == ["a"]
        summary = orjson.loads((tmp_path / "summary.json").read_bytes())
        assert summary["stopped_by"] == "SIGINT"
        assert (summary["lines_ok"], summary["lines_failed"], summary["lines_unfinished"]) == (
            1,
            0,
            1,
        )

        server.answer_slow = True
        server.sent.clear()
        async with asyncio.timeout(30.0):
            assert await run_job(args, io.StringIO()) == 0
    assert server.sent == ["slow"]  # "a" is not sent again
    assert sorted(map(str, _written_ids(tmp_path))) == ["a", "s"]


class SummaryInterruptingStream(io.StringIO):
    """Sends this process a SIGINT as the summary starts being written: after the job's
    last answer, in the window where its signal handlers were already removed."""

    def write(self, text: str) -> int:
        if text.startswith("batch summary"):
            os.kill(os.getpid(), signal.SIGINT)
        return super().write(text)


async def test_a_third_sigint_while_the_summary_is_written_is_ignored(tmp_path: Path) -> None:
    """The handlers were removed before the journals were closed and the summary written:
    a SIGINT then raised KeyboardInterrupt, and the summary (printed and --summary-json)
    and the exit status were lost."""
    async with PackRefusingServer().running() as server:
        args = parse_arguments(_job(tmp_path, server.port))
        interrupter = asyncio.create_task(_interrupt_twice(server))
        stream = SummaryInterruptingStream()
        try:
            # Awaited in this task, not wrapped in another: a KeyboardInterrupt raised in
            # the job is caught here instead of ending the test session.
            async with asyncio.timeout(30.0):
                status = await run_job(args, stream)
        except KeyboardInterrupt:
            pytest.fail("a SIGINT while the summary was written raised KeyboardInterrupt")
        await interrupter
    assert status == 128 + signal.SIGINT
    assert "batch summary:" in stream.getvalue()
    summary = orjson.loads((tmp_path / "summary.json").read_bytes())
    assert summary["stopped_by"] == "SIGINT"
    assert summary["lines_ok"] == len(_written_ids(tmp_path))


class RecordingClient:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def stop(self) -> None:
        self.calls.append("stop")

    def abort(self) -> None:
        self.calls.append("abort")


def test_the_first_signal_stops_the_second_aborts_later_ones_do_nothing() -> None:
    client = RecordingClient()
    stream = io.StringIO()
    interrupts = Interrupts(client, stream)
    assert interrupts.first is None
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGINT, signal.SIGTERM):
        interrupts.handle(signum)
    assert client.calls == ["stop", "abort"]
    assert interrupts.first is signal.SIGTERM
    assert stream.getvalue() == "\nbatch: SIGTERM: finishing requests in flight\n"
