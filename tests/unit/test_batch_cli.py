"""The batch command's option parsing, and how it reads INPUT."""

from __future__ import annotations

import http.server
import threading
from pathlib import Path

import orjson
import pytest

from app.batchclient.cli import _Source, main, parse_headers
from app.batchclient.journal import IdSet, Journal, RefusedLines, line_digest


def test_header_option_parsing() -> None:
    assert parse_headers(["Authorization: Bearer t", "X-Job:  7 "]) == {
        "Authorization": "Bearer t",
        "X-Job": "7",
    }
    for bad in ("no colon", ": empty name", "X: a\r\nInjected: 1"):
        with pytest.raises(ValueError):
            parse_headers([bad])


LINES = [
    b'{"id": 2, "inputs": "a"}',
    b"not json",  # line 2: an error by its line number, whatever ids other lines have
    b'{"inputs": "b"}',  # id 3
    b'{"id": 3, "inputs": "c"}',  # id 3 again: an error, not skipped
    b'{"id": "x", "inputs": "d"}',
]


def read(
    tmp_path: Path,
    resumed: list[int | str],
    refused_lines: set[int] | None = None,
    lines: list[bytes] = LINES,
    refused_as: dict[int, bytes | None] | None = None,
) -> tuple[_Source, list[object], list[dict]]:
    """`refused_lines`: line numbers a previous run refused as they read now; `refused_as`:
    line numbers refused when they held other content (None: a record with no digest)."""
    source_path = tmp_path / "input.jsonl"
    source_path.write_bytes(b"\n".join(lines) + b"\n")
    done = IdSet()
    for item_id in resumed:
        done.add(item_id)
    refused = RefusedLines()
    for number in refused_lines or set():
        refused.add(number, line_digest(lines[number - 1]))
    for number, content in (refused_as or {}).items():
        refused.add(number, None if content is None else line_digest(content))
    errors = Journal(tmp_path / "errors.jsonl")
    source = _Source(source_path, done, errors, refused)
    sent = [item.id for item in source.items()]
    errors.close()
    written = errors.path.read_bytes().splitlines() if errors.path.exists() else []
    return source, sent, [orjson.loads(line) for line in written]


def test_every_line_is_sent_or_an_error_even_when_ids_collide(tmp_path: Path) -> None:
    source, sent, errors = read(tmp_path, resumed=[])
    assert sent == [2, 3, "x"]
    assert [(e["id"], e["line"], e["error"]["type"]) for e in errors] == [
        (2, 2, "invalid_line"),
        (3, 4, "duplicate_id"),
    ]
    assert (source.invalid, source.skipped) == (2, 0)


def test_a_resumed_run_skips_the_lines_a_previous_run_finished(tmp_path: Path) -> None:
    # What the first run wrote: ids 2 and 3 answered, lines 2 and 4 refused.
    source, sent, errors = read(tmp_path, resumed=[2, 3], refused_lines={2, 4})
    assert sent == ["x"]
    assert errors == []
    assert (source.invalid, source.skipped) == (0, 4)


def test_a_duplicate_of_a_line_a_previous_run_answered_is_still_an_error(tmp_path: Path) -> None:
    """Skipped as "answered" (its id was in OUTPUT), the later line with the same id was
    lost: no answer and no error for it, and the run reported complete."""
    lines = [b'{"id": "a", "inputs": "first"}', b'{"id": "a", "inputs": "second"}']
    _, sent, errors = read(tmp_path, resumed=["a"], lines=lines)
    assert sent == []
    assert [(e["line"], e["error"]["type"]) for e in errors] == [(2, "duplicate_id")]


def test_a_refused_line_does_not_mark_another_line_with_its_id_as_done(tmp_path: Path) -> None:
    """A refusal recorded with line 3's id (a duplicate of line 1) made the resumed run
    skip line 1 as done, though line 1 was never answered (stopped before its turn)."""
    lines = [b'{"id": "z", "inputs": "z"}', b'{"id": "a", "inputs": "first a"}', b'{"id": "a"}']
    _, sent, errors = read(tmp_path, resumed=["z"], refused_lines={3}, lines=lines)
    assert sent == ["a"] and errors == []


def test_a_refused_line_edited_before_the_resume_is_read_again(tmp_path: Path) -> None:
    """Refusals are recorded by line number: a line fixed (or moved by an insertion) between
    runs was skipped as refused, so the new content at that number was never sent and
    appeared nowhere."""
    lines = [b'{"id": "a", "inputs": "a"}', b'{"id": "b", "inputs": "fixed"}']
    _, sent, errors = read(tmp_path, resumed=["a"], refused_as={2: b"not json"}, lines=lines)
    assert sent == ["b"] and errors == []


def test_a_refusal_recorded_without_a_digest_still_skips_its_line(tmp_path: Path) -> None:
    _, sent, errors = read(tmp_path, resumed=[2, 3], refused_as={2: None, 4: None})
    assert sent == ["x"] and errors == []


def test_a_refusal_records_the_digest_of_the_line_it_refused(tmp_path: Path) -> None:
    _, _, errors = read(tmp_path, resumed=[])
    assert [e["line_digest"] for e in errors] == [line_digest(LINES[1]), line_digest(LINES[3])]


def test_an_invalid_line_takes_no_id_a_later_line_could_have(tmp_path: Path) -> None:
    lines = [b'{"id": 10, "inputs": "a"}', b"not json", b'{"id": 2, "inputs": "b"}']
    _, sent, errors = read(tmp_path, resumed=[], lines=lines)
    assert sent == [10, 2]
    assert [(e["line"], e["error"]["type"]) for e in errors] == [(2, "invalid_line")]


@pytest.mark.parametrize(
    "option",
    [
        ["--concurrency", "0"],
        ["--inputs-per-request", "0"],
        ["--rate", "0"],
        ["--timeout-ms", "0"],
        ["--max-retries", "-1"],
        ["--max-deadline-retries", "-1"],
        ["--max-engine-lost-retries", "-1"],
        ["--progress-interval", "0"],
        ["--header", "no colon"],
        # NaN compares false with any bound: a NaN timeout fired at once and failed every
        # line; an infinite rate divided by zero in the limiter.
        ["--timeout-ms", "nan"],
        ["--rate", "inf"],
        ["--progress-interval", "nan"],
        # Found only once the run started: exit 1, as if the job could not run.
        ["--header", "X-Team: café ☕"],
        ["--url", "127.0.0.1:8000"],
    ],
)
def test_a_value_that_cannot_work_is_a_usage_error(tmp_path: Path, option: list[str]) -> None:
    """Exit 2 (usage), as the command documents, not 1 (could not run) or a run."""
    source = tmp_path / "in.jsonl"
    source.write_text('{"inputs": "x"}\n')
    command = [str(source), "--url", "http://127.0.0.1:9", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as stopped:
        main([*command, *option])
    assert stopped.value.code == 2


class _Answering(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"outputs": [[0.5]]}'
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_a_line_fixed_after_a_run_refused_it_lets_the_rerun_succeed(tmp_path: Path) -> None:
    """The refused line's old record stays in the errors file; counted as an error of this
    input, it made every rerun exit 3 though the fixed line was answered."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answering)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    source = tmp_path / "in.jsonl"
    out = tmp_path / "out.jsonl"
    command = [str(source), "--url", f"http://127.0.0.1:{server.server_port}"]
    command += ["--out", str(out), "--progress", "lines"]
    try:
        source.write_bytes(b'{"inputs": "a"}\nnot json\n')
        assert main(command) == 3
        source.write_bytes(b'{"inputs": "a"}\n{"inputs": "b"}\n')
        assert main(command) == 0
        assert [orjson.loads(line)["id"] for line in out.read_bytes().splitlines()] == [1, 2]
        source.write_bytes(b'{"inputs": "a"}\n{"inputs": "b"}\nstill not json\n')
        assert main(command) == 3  # a refusal that still applies still counts
        assert main(command) == 3  # and still does when the rerun skips its line
    finally:
        server.shutdown()
        server.server_close()
