"""Flat memory: a 1,000,000-line job stays under 200 MB resident, resume included.

Sending a million requests through any server takes minutes, so this test makes the job
one that is 98 % done: OUTPUT already holds answers for the first 980,000 ids (as a
killed run would have left it). The client then does everything a million-line job
does to its memory except send the first 980,000 requests: it reads all 1,000,000 ids
back, holds them in its id set, streams the whole input, and sends the last 20,000
lines (packed 64 a request) through the stub answering at once. The resident peak is
the client process's own, from ``wait4``. The full run (all 1,000,000 lines sent) is
measured in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.batch import batch_command
from tests.support.flaky_server import Misbehaviour, running_flaky_server
from tests.support.server import REPO_ROOT

pytestmark = pytest.mark.e2e

LINES = 1_000_000
ALREADY_DONE = 980_000
LIMIT_BYTES = 200 * 1024 * 1024


def test_a_million_line_job_resumes_and_finishes_under_200_mb(tmp_path: Path) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with source.open("wb") as file:
        for i in range(LINES):
            file.write(b'{"id":"doc-%d","inputs":"short line number %d"}\n' % (i, i))
    with out.open("wb") as file:
        for i in range(ALREADY_DONE):
            file.write(b'{"id":"doc-%d","model":"stub","outputs":[[0.5]],"usage":{}}\n' % i)
    with running_flaky_server(Misbehaviour(record_inputs=False)) as server:
        command = batch_command(
            source, f"http://127.0.0.1:{server.port}", out, "--inputs-per-request", "64"
        )
        job = subprocess.Popen(command, cwd=REPO_ROOT, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(job.pid, 0)
        job.returncode = os.waitstatus_to_exitcode(status)
        requests = server.requests
    assert job.returncode == 0
    assert requests == (LINES - ALREADY_DONE) // 64 + 1  # only the unfinished lines went
    with out.open("rb") as file:
        assert sum(1 for _ in file) == LINES
    peak_bytes = usage.ru_maxrss * 1024  # Linux reports kilobytes
    assert peak_bytes < LIMIT_BYTES, f"peak resident {peak_bytes / 2**20:.0f} MiB"
