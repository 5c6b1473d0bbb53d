"""`steadyserve batch` against a real steadyserve (the bundled model) on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.support.batch import assert_each_id_exactly_once, run_batch, write_input
from tests.support.server import running_server

pytestmark = pytest.mark.e2e

WORDS = ["queue", "batch", "latency", "tail", "envoy", "token", "bucket", "scheduler"]


def _lines() -> list[dict[str, object]]:
    lines: list[dict[str, object]] = []
    for i in range(120):
        words = " ".join(WORDS[(i * 3 + k) % len(WORDS)] for k in range(1 + i % 7))
        if i % 10 == 4:
            lines.append({"id": f"pair-{i}", "inputs": [f"{words} one", f"{words} two"]})
        else:
            lines.append({"inputs": f"{words} number {i}"})  # id: the line number
    lines[57] = {"id": "empty", "inputs": ""}  # the server's 422: inputs must not be empty
    return lines


def test_packing_gives_the_same_vectors_and_every_id_once(tmp_path: Path) -> None:
    lines = _lines()
    ids = [line.get("id", number) for number, line in enumerate(lines, start=1)]
    source = tmp_path / "in.jsonl"
    write_input(source, lines)
    single, packed = tmp_path / "single.jsonl", tmp_path / "packed.jsonl"
    with running_server(tmp_path) as server:
        one = run_batch(source, server.base_url, single, "--concurrency", "16")
        many = run_batch(
            source, server.base_url, packed, "--concurrency", "4", "--inputs-per-request", "8"
        )
    for done, out in ((one, single), (many, packed)):
        assert done.returncode == 3, done.stderr  # the empty line is in errors
        answered, failed = assert_each_id_exactly_once(
            ids, out, out.with_name(out.stem + ".errors.jsonl")
        )
        assert [(f["id"], f["status"], f["error"]["type"]) for f in failed] == [
            ("empty", 422, "invalid_request")
        ]
        assert all(a["model"] == "all-MiniLM-L6-v2" for a in answered)
    by_id = {
        out: {repr(a["id"]): np.array(a["outputs"]) for a in assert_each_id_exactly_once(
            ids, out, out.with_name(out.stem + ".errors.jsonl"))[0]}
        for out in (single, packed)
    }  # fmt: skip
    assert by_id[single].keys() == by_id[packed].keys()
    for key, vectors in by_id[single].items():
        expected_rows = 2 if key.startswith("'pair-") else 1
        assert vectors.shape == (expected_rows, 384)
        # The same vectors up to the float noise of a different batch shape (the project's
        # tolerance); a vector given to the wrong line would be far below it.
        cosines = (by_id[packed][key] * vectors).sum(axis=1)
        assert cosines.min() >= 0.9999, (key, cosines)
