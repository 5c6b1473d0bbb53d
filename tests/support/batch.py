"""Helpers for the batch client's end-to-end tests: write inputs, run the real CLI, read
what it wrote back."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, AnyStr

import orjson

from tests.support.server import REPO_ROOT


def write_input(path: Path, lines: Iterable[dict[str, Any]]) -> None:
    with path.open("wb") as file:
        for line in lines:
            file.write(orjson.dumps(line) + b"\n")


def batch_command(input_path: Path, url: str, out: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "app.cli",
        "batch",
        str(input_path),
        "--url",
        url,
        "--out",
        str(out),
        "--progress",
        "lines",
        "--progress-interval",
        "1",
        *extra,
    ]


@contextlib.contextmanager
def killed_on_exit(process: subprocess.Popen[AnyStr]) -> Iterator[subprocess.Popen[AnyStr]]:
    """`process` (a job the test started and drives itself), killed by its Popen and reaped
    on exit if still running: a failing assertion must not leave it behind."""
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait()
        for stream in (process.stdin, process.stdout, process.stderr):
            if stream is not None:
                stream.close()


def run_batch(
    input_path: Path, url: str, out: Path, *extra: str, timeout: float = 120.0
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        batch_command(input_path, url, out, *extra),
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def assert_each_id_exactly_once(
    expected: Sequence[object], output: Path, errors: Path
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every expected id is in OUTPUT or errors, exactly once, and nothing else is."""
    answered = read_lines(output)
    failed = read_lines(errors)
    counts = Counter(orjson.dumps(line["id"]) for line in answered + failed)
    duplicated = [key for key, n in counts.items() if n > 1]
    assert not duplicated, f"ids written more than once: {duplicated[:5]}"
    assert set(counts) == {orjson.dumps(i) for i in expected}
    return answered, failed
