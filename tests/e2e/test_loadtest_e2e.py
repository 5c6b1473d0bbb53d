"""The load-testing kit against a real steadyserve on 127.0.0.1: the generator's files,
the locustfile headless, and hey.sh. One server serves the module's tests.

Pass conditions are about outcomes (files exist, no request failed), never about how
fast the noisy machine answered.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.server import REPO_ROOT, ServerProcess, running_server

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    # The load tools are the point, not the server's capacity: on a slow machine the
    # default queue-delay budget refuses some of even 20 requests a second.
    env = {"STEADY_MAX_QUEUE_DELAY_MS": "60000"}
    with running_server(tmp_path_factory.mktemp("loadtest-server"), env) as process:
        yield process


def _run(command: list[str], timeout_s: float, env: dict[str, str] | None = None) -> str:
    completed = subprocess.run(
        command,
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    output = completed.stdout + completed.stderr
    assert completed.returncode == 0, f"{command} exited {completed.returncode}:\n{output}"
    return completed.stdout


def test_generator_run_writes_table_json_and_plots(server: ServerProcess, tmp_path: Path) -> None:
    out = tmp_path / "run"
    stdout = _run(
        [
            sys.executable,
            "-m",
            "loadtest",
            "run",
            "--url",
            f"{server.base_url}/infer",
            "--rate",
            "20",
            "--duration",
            "5s",
            "--words",
            "lognormal:12:0.8:40",
            "--out",
            str(out),
            "--slo-p99-ms",
            "60000",
            "--max-error-rate",
            "0",
        ],
        timeout_s=120,
    )
    for field in ("throughput", "latency ms", "p99.9", "status", "200: 100", "PASS"):
        assert field in stdout
    summary = json.loads((out / "report.json").read_text())["summary"]
    assert summary["requests"] == 100
    assert summary["ok"] == 100
    assert summary["latency_ms"]["p50"] <= summary["latency_ms"]["p99"]
    for name in ("latency_over_time.png", "latency_histogram.png", "throughput_errors.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC


def test_locustfile_runs_headless_without_failures(server: ServerProcess, tmp_path: Path) -> None:
    prefix = tmp_path / "locust"
    _run(
        [
            sys.executable,
            "-m",
            "locust",
            "-f",
            "loadtest/locustfile.py",
            "--headless",
            "--host",
            server.base_url,
            "--csv",
            str(prefix),
            "--exit-code-on-error",
            "1",
            "--only-summary",
            "--loglevel",
            "WARNING",
        ],
        timeout_s=120,
        env={"LOADTEST_STAGES": "4s:4", "LOADTEST_WORDS": "lognormal:12:0.8:40"},
    )
    with (tmp_path / "locust_stats.csv").open() as stats_file:
        rows = {row["Name"]: row for row in csv.DictReader(stats_file)}
    aggregated = rows["Aggregated"]
    assert int(aggregated["Request Count"]) > 0
    assert int(aggregated["Failure Count"]) == 0


def test_hey_script_runs_and_prints_the_summary(server: ServerProcess, tmp_path: Path) -> None:
    # `make test` installs hey (tools/ensure-tools.sh); without it this test fails, not skips.
    assert shutil.which("hey"), "hey is not installed: run tools/ensure-tools.sh"
    out = tmp_path / "hey"
    stdout = _run(
        [
            "bash",
            "loadtest/hey.sh",
            "-u",
            f"{server.base_url}/infer",
            "-c",
            "4",
            "-n",
            "100",
            "-o",
            str(out),
            "--",
            "--max-error-rate",
            "0",
        ],
        timeout_s=120,
    )
    for field in ("throughput", "latency ms", "p99", "200: 100", "PASS"):
        assert field in stdout
    assert json.loads((out / "report.json").read_text())["summary"]["ok"] == 100
