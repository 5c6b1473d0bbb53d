"""`steadyserve batch --retry-errors`: a rerun that sends again the lines an earlier run
recorded as failed, replacing their records, against a loopback server."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import orjson
import pytest

from app.batchclient.cli import main
from app.batchclient.journal import IdSet, drop_failures, failed_lines_of


class _FailsUntilFixed(http.server.BaseHTTPRequestHandler):
    """422 to the input "flaky" while `broken` is set, 200 to anything else."""

    broken = threading.Event()
    sent: ClassVar[list[bytes]] = []

    def do_POST(self) -> None:
        request = self.rfile.read(int(self.headers["Content-Length"]))
        self.sent.append(request)
        if b"flaky" in request and self.broken.is_set():
            status, body = 422, b'{"error": {"type": "invalid_request", "message": "no"}}'
        else:
            status, body = 200, b'{"outputs": [[0.5]]}'
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server_url() -> Iterator[str]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _FailsUntilFixed)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _FailsUntilFixed.broken.set()
    _FailsUntilFixed.sent.clear()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


def _records(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def test_retry_errors_sends_the_failed_lines_again_and_replaces_their_records(
    tmp_path: Path, server_url: str
) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"inputs": "a"}\n{"inputs": "flaky"}\nnot json\n{"inputs": "c"}\n')
    out = tmp_path / "out.jsonl"
    errors = tmp_path / "out.errors.jsonl"
    command = [str(source), "--url", server_url, "--out", str(out), "--progress", "off"]
    assert main(command) == 3
    assert sorted((r["id"], r["error"]["type"]) for r in _records(errors)) == [
        (2, "invalid_request"),
        (3, "invalid_line"),
    ]
    _FailsUntilFixed.broken.clear()  # the server can answer it now
    assert main(command) == 3  # a plain rerun skips the failed line
    assert len(_FailsUntilFixed.sent) == 3
    assert main([*command, "--retry-errors"]) == 3  # the invalid line is still an error
    assert len(_FailsUntilFixed.sent) == 4  # the failed line, and only it, sent again
    assert sorted(r["id"] for r in _records(out)) == [1, 2, 4]
    # Its failure record is gone (it is answered now); the invalid line's stays.
    assert [(r["id"], r["error"]["type"]) for r in _records(errors)] == [(3, "invalid_line")]
    assert main(command) == 3  # and every line is still in exactly one file
    assert len(_FailsUntilFixed.sent) == 4


def test_a_line_failing_again_has_one_record_not_two(tmp_path: Path, server_url: str) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"id": "f", "inputs": "flaky"}\n')
    out = tmp_path / "out.jsonl"
    command = [str(source), "--url", server_url, "--out", str(out), "--progress", "off"]
    assert main(command) == 3
    assert main([*command, "--retry-errors"]) == 3
    assert [r["id"] for r in _records(tmp_path / "out.errors.jsonl")] == ["f"]
    assert len(_FailsUntilFixed.sent) == 2


def test_only_failures_of_lines_in_the_input_are_dropped(tmp_path: Path) -> None:
    """A record whose id is no line of this input (another input's, or one since removed)
    would be sent by nobody: it stays."""
    errors = tmp_path / "out.errors.jsonl"
    lines = [
        b'{"id":1,"status":422,"error":{"type":"invalid_request"},"attempts":1,"retryable":false}',
        b'{"id":2,"status":null,"error":{"type":"invalid_line"},"attempts":0,"retryable":false,'
        b'"line":2,"line_digest":"x"}',
        b'{"id":"gone","status":504,"error":{"type":"deadline"},"attempts":3,"retryable":true}',
    ]
    errors.write_bytes(b"\n".join(lines) + b"\n")
    source = tmp_path / "in.jsonl"
    source.write_bytes(b'{"inputs": "a"}\nnot json\n{"id": "other", "inputs": "b"}\n')
    retried = failed_lines_of(source, errors)
    assert 1 in retried and "gone" not in retried and len(retried) == 1
    assert drop_failures(errors, retried) == 1
    assert errors.read_bytes() == b"\n".join(lines[1:]) + b"\n"
    assert drop_failures(errors, IdSet()) == 0
    assert not (tmp_path / "out.errors.jsonl.retrying").exists()
