"""The SLA verdict, the report files and the HTTP client, against a stub server on 127.0.0.1.

The stub runs on its own event loop in a thread of the test process; the generator runs
through its real command line (`loadtest.cli.main`), so exit codes are the ones CI sees.
Pass and fail cases are built so that timing cannot flip them: passing runs get a limit
far above any loopback latency, failing runs a server delay far above the limit, or
errors.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.cli import main, result_from_hey_csv
from loadtest.httpclient import HttpConnection, RequestError, Target, retry_after_seconds
from loadtest.report import judge, summarize
from loadtest.report_output import format_table
from loadtest.stub_server import StubBehaviour, StubServer


class StubInThread:
    """A `StubServer` on its own loop in a daemon thread; ``url`` is valid inside ``with``."""

    def __init__(self, behaviour: StubBehaviour) -> None:
        self.server = StubServer(behaviour)
        self._loop = asyncio.new_event_loop()
        self._port: int | None = None
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._serve())
        self._loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        async with self.server.serving() as port:
            self._port = port
            self._started.set()
            await self._stop.wait()

    def __enter__(self) -> StubInThread:
        self._thread.start()
        if not self._started.wait(timeout=30):
            raise TimeoutError("stub server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._port}/infer"


@pytest.fixture
def fast_ok_stub() -> Iterator[StubInThread]:
    with StubInThread(StubBehaviour(status=200)) as stub:
        yield stub


def run_cli(url: str, out: Path, *extra: str) -> int:
    return main(
        [
            "run",
            "--url",
            url,
            "--rate",
            "200",
            "--duration",
            "1s",
            "--out",
            str(out),
            "--quiet",
            "--drain-timeout",
            "20s",
            *extra,
        ]
    )


def test_passing_run_exits_0_and_writes_table_json_and_plots(
    fast_ok_stub: StubInThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = run_cli(fast_ok_stub.url, tmp_path, "--slo-p99-ms", "60000", "--max-error-rate", "0")
    output = capsys.readouterr().out
    assert code == 0
    assert "verdict" in output and "PASS" in output
    for field in ("throughput", "latency ms", "p99.9", "status", "200: 200"):
        assert field in output
    document = json.loads((tmp_path / "report.json").read_text())
    assert document["summary"]["requests"] == 200
    assert document["summary"]["ok"] == 200
    assert document["summary"]["verdict"]["passed"] is True
    assert fast_ok_stub.server.requests == 200
    for name in ("latency_over_time.png", "latency_histogram.png", "throughput_errors.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_slow_server_fails_the_latency_slo_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with StubInThread(StubBehaviour(status=200, delay_s=0.05)) as stub:
        code = run_cli(stub.url, tmp_path, "--slo-p99-ms", "1", "--no-plots")
    captured = capsys.readouterr()
    assert code == 1
    assert "FAIL" in captured.out
    assert "p99 latency" in captured.err and "exceeds the SLO of 1 ms" in captured.err


def test_failing_server_fails_the_error_rate_with_a_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with StubInThread(StubBehaviour(status=500)) as stub:
        code = run_cli(stub.url, tmp_path, "--max-error-rate", "0.001", "--no-plots")
    captured = capsys.readouterr()
    assert code == 1
    assert "error rate 100.000% exceeds the maximum of 0.100%" in captured.err
    assert "500: 200" in captured.out


def test_rejecting_server_is_retried_after_retry_after_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Every answer is a 429 with Retry-After: 0, so each request is retried max-retries
    # times, then counted as a 429.
    with StubInThread(StubBehaviour(status=429, retry_after_s=0)) as stub:
        code = main(
            [
                "run",
                "--url",
                stub.url,
                "--rate",
                "50",
                "--duration",
                "1s",
                "--retry-429",
                "--max-retries",
                "2",
                "--out",
                str(tmp_path),
                "--quiet",
                "--no-plots",
            ]
        )
        requests = stub.server.requests
    assert code == 0  # no verdict asked for
    summary = json.loads((tmp_path / "report.json").read_text())["summary"]
    assert summary["retried_requests"] == 50
    assert summary["retry_attempts"] == 100
    assert summary["share_429"] == 1.0
    assert requests == 150
    assert "50 requests after 429 (100 retries)" in capsys.readouterr().out


def test_refused_connections_are_errors_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with StubInThread(StubBehaviour()) as stub:
        url = stub.url  # the port is free again once the stub has stopped
    code = run_cli(url, tmp_path, "--max-error-rate", "0.5", "--no-plots")
    assert code == 1
    assert "connect: 200" in capsys.readouterr().out


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--mode", "closed", "--duration", "1s"]) == 2
    assert "--concurrency" in capsys.readouterr().err
    assert main(["run", "--rate", "10", "--stages", "10s"]) == 2


def test_an_input_file_that_cannot_be_read_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It was a traceback with exit 1, the status of a failed SLA."""
    missing = tmp_path / "missing.jsonl"
    assert main(["run", "--rate", "10", "--duration", "1s", "--body-jsonl", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_files_that_cannot_be_written_do_not_lose_the_verdict(
    fast_ok_stub: StubInThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The run's files were written before the table: a bad --out lost the table and the
    verdict, and exited 1 as if the SLA had failed."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    code = run_cli(fast_ok_stub.url, blocked / "out", "--slo-p99-ms", "60000", "--no-plots")
    captured = capsys.readouterr()
    assert code == 3
    assert "PASS" in captured.out
    assert "cannot write the run's files" in captured.err


def test_hey_csv_rows_become_the_same_summary() -> None:
    rows = [
        {"response-time": f"{0.010 + i * 0.001:.4f}", "status-code": "200", "offset": f"{i * 0.1}"}
        for i in range(10)
    ]
    rows.append({"response-time": "0.0020", "status-code": "429", "offset": "1.0"})
    result = result_from_hey_csv(rows, concurrency=2, expected=12)
    summary = summarize(result, "http://example.invalid/infer", "hey")
    summary.verdict = judge(summary, slo_p99_ms=100.0, max_error_rate=0.01)
    assert summary.requests == 12
    assert summary.ok == 10
    assert summary.status_counts == {"200": 10, "429": 1}
    assert summary.errors_by_kind == {"unfinished": 1}
    assert summary.latency_ms["p50"] == pytest.approx(14.5)
    assert summary.latency_ms["max"] == pytest.approx(19.0)
    assert not summary.verdict.passed
    assert "error rate 16.667%" in summary.verdict.reasons[0]
    assert "429: 1" in format_table(summary)


# -- the HTTP client's framing, against hand-written responses ------------------------------


async def _serve_raw(response: bytes) -> tuple[asyncio.Server, Target]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(response)
        await writer.drain()
        if b"connection: close" in response.lower():
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, Target.parse(f"http://127.0.0.1:{port}/infer")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("3", 3.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("Thu, 01 Jan 2026 00:00:30 GMT", 30.0),
        ("Wed, 31 Dec 2025 23:59:00 GMT", 0.0),  # a date already past: retry now
        ("-1", None),  # would be no wait at all, as would NaN
        ("nan", None),
        ("inf", None),
        ("soon", None),
        ("Thu, 01 Jan 99999999999999999999 00:00:00 GMT", None),  # OverflowError
        ("Thu, 01 Jan 2026 00:00:00 +99999999999999999999", None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(value: str, seconds: float | None) -> None:
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC).timestamp()
    assert retry_after_seconds(value, now) == seconds


@pytest.mark.parametrize(
    ("raw", "status", "retry_after", "body_bytes"),
    [
        (b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello", 200, None, 5),
        (
            b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 3\r\nContent-Length: 2\r\n\r\n{}",
            429,
            3.0,
            2,
        ),
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"4\r\nwiki\r\n5;ext=1\r\npedia\r\n0\r\n\r\n",
            200,
            None,
            30,  # body bytes on the wire, chunk framing included
        ),
        (b"HTTP/1.1 503 Unavailable\r\nConnection: close\r\n\r\ndraining", 503, None, 8),
    ],
)
async def test_client_reads_each_framing(
    raw: bytes, status: int, retry_after: float | None, body_bytes: int
) -> None:
    server, target = await _serve_raw(raw)
    async with server:
        connection = await HttpConnection.open(target)
        response = await connection.request(target.post_bytes(b"{}"), timeout_s=10.0)
        connection.close()
    assert (response.status, response.retry_after_s, response.body_bytes) == (
        status,
        retry_after,
        body_bytes,
    )


async def test_client_times_out_and_drops_the_connection() -> None:
    never_answers = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await never_answers.wait()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    target = Target.parse(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/")
    async with server:
        connection = await HttpConnection.open(target)
        with pytest.raises(RequestError) as caught:
            await connection.request(target.post_bytes(b"{}"), timeout_s=0.05)
        assert caught.value.kind == RequestError.TIMEOUT
        assert not connection.usable
        never_answers.set()


def test_without_matplotlib_the_run_still_writes_table_and_json_and_names_the_extra(
    fast_ok_stub: StubInThread,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The README's plain install (`make serve`) has no matplotlib: `import matplotlib`
    # raises ImportError there, as it does with the module set to None here.
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code = run_cli(fast_ok_stub.url, tmp_path, "--slo-p99-ms", "60000")
    captured = capsys.readouterr()
    assert code == 0
    assert "PASS" in captured.out and "200: 200" in captured.out
    assert json.loads((tmp_path / "report.json").read_text())["summary"]["ok"] == 200
    assert "steadyserve[plots]" in captured.err
    assert not list(tmp_path.glob("*.png"))
