"""Flat memory: a 1,000,000-line job runs, and resumes, under 200 MB resident.

The whole million lines go through the stub answering at once (packed 64 a request, so
the run takes seconds, not the hours a real model would), then the same command runs
again on the finished job: it reads all 1,000,000 ids back and sends nothing. Both
peaks are the client process's own resident memory, from ``wait4``. What grows with the
job is only the id set (about 80 bytes an id); input, output and answers stream.

The peak is the client's own, as its ``--summary-json`` reports it (VmHWM): ``wait4``'s
ru_maxrss would include this pytest process, which Linux carries over into the child
across fork and exec.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import orjson
import pytest

from tests.support.batch import batch_command
from tests.support.flaky_server import Misbehaviour, running_flaky_server
from tests.support.server import REPO_ROOT

pytestmark = pytest.mark.e2e

LINES = 1_000_000
LIMIT_BYTES = 200 * 1024 * 1024


def _run_measured(command: list[str], summary: Path) -> tuple[int, int]:
    """Exit status and peak resident bytes of the client process."""
    done = subprocess.run(
        [*command, "--summary-json", str(summary)], cwd=REPO_ROOT, stderr=subprocess.DEVNULL
    )
    peak_mb = orjson.loads(summary.read_bytes())["peak_resident_mb"]
    return done.returncode, int(peak_mb * 2**20)


def test_a_million_line_job_runs_and_resumes_under_200_mb(tmp_path: Path) -> None:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    with source.open("wb") as file:
        for i in range(LINES):
            file.write(b'{"id":"doc-%d","inputs":"short line number %d"}\n' % (i, i))
    with running_flaky_server(Misbehaviour(record_inputs=False)) as server:
        command = batch_command(
            source, f"http://127.0.0.1:{server.port}", out, "--inputs-per-request", "64"
        )
        status, run_peak = _run_measured(command, tmp_path / "run.json")
        requests_after_run = server.requests
        resumed_status, resume_peak = _run_measured(command, tmp_path / "resume.json")
        requests_after_resume = server.requests
    assert status == 0 and resumed_status == 0
    assert requests_after_run == -(-LINES // 64)
    assert requests_after_resume == requests_after_run  # everything was already done
    with out.open("rb") as file:
        assert sum(1 for _ in file) == LINES
    for name, peak in (("run", run_peak), ("resume", resume_peak)):
        assert peak < LIMIT_BYTES, f"{name}: peak resident {peak / 2**20:.0f} MiB"
