"""The batch command's option parsing, and how it reads INPUT."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from app.batchclient.cli import _Source, main, parse_headers
from app.batchclient.journal import IdSet, Journal


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
    b"not json",  # its id is its line number, 2: taken, yet it must reach errors
    b'{"inputs": "b"}',  # id 3
    b'{"id": 3, "inputs": "c"}',  # id 3 again: an error, not skipped
    b'{"id": "x", "inputs": "d"}',
]


def read(tmp_path: Path, resumed: list[int | str]) -> tuple[_Source, list[object], list[dict]]:
    source_path = tmp_path / "input.jsonl"
    source_path.write_bytes(b"\n".join(LINES) + b"\n")
    done = IdSet()
    for item_id in resumed:
        done.add(item_id)
    errors = Journal(tmp_path / "errors.jsonl")
    source = _Source(source_path, done, errors)
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


def test_a_resumed_run_skips_the_ids_a_previous_run_finished(tmp_path: Path) -> None:
    source, sent, errors = read(tmp_path, resumed=[2, 3])
    assert sent == ["x"]
    assert errors == []
    assert (source.invalid, source.skipped) == (0, 4)


@pytest.mark.parametrize(
    "option",
    [
        ["--concurrency", "0"],
        ["--inputs-per-request", "0"],
        ["--rate", "0"],
        ["--timeout-ms", "0"],
        ["--max-retries", "-1"],
        ["--progress-interval", "0"],
        ["--header", "no colon"],
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
