"""wrk's timeout and timeouts in the overload bench (loadtest/wrk.py, overload_bench.py).

wrk leaves an answer slower than its `--timeout` out of its latency histogram (percentiles
and max) and counts it, and every connection stuck that long (once per 2 s check), in
`timeouts`. Run with 10 s against a server whose deadlines reach 60 s, its "slowest answer"
could never pass 10 s, and its timeouts were summed into "socket errors". A stand-in `wrk`
on PATH records what it is run with; no server, no real wrk."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from loadtest.localserver import served_settings
from loadtest.overload_bench import markdown
from loadtest.wrk import run_wrk, wrk_timeout_s

RESULT = {
    "seconds": 1.0, "ok": 5, "throttled": 0, "unavailable": 0, "server_error": 0,
    "other": 0, "p50_ms": 1.0, "p99_ms": 2.0, "max_ms": 3.0,
    "connect_errors": 0, "read_errors": 0, "write_errors": 0, "timeouts": 0,
}  # fmt: skip


@pytest.fixture
def wrk_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A `wrk` first on PATH that writes its arguments (one a line) to the returned file
    and prints a RESULT line."""
    recorded = tmp_path / "arguments"
    wrk = tmp_path / "bin" / "wrk"
    wrk.parent.mkdir()
    script = [
        "#!/bin/sh",
        f'printf "%s\\n" "$@" > {recorded}',
        f"echo 'RESULT {json.dumps(RESULT)}'",
    ]
    wrk.write_text("\n".join(script) + "\n")
    wrk.chmod(wrk.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{wrk.parent}:{os.environ.get('PATH', '')}")
    return recorded


def _timeout_given(recorded: Path) -> float:
    arguments = recorded.read_text().splitlines()
    value = arguments[arguments.index("--timeout") + 1]
    assert value.endswith("s")
    return float(value.removesuffix("s"))


@pytest.mark.parametrize("max_timeout_ms", [None, "120000"])
def test_wrk_waits_past_the_longest_deadline_the_server_serves_with(
    wrk_arguments: Path, max_timeout_ms: str | None
) -> None:
    env = (
        {}
        if max_timeout_ms is None
        else {
            "STEADY_MAX_TIMEOUT_MS": max_timeout_ms,
            "STEADY_STUCK_COMPUTE_S": str(float(max_timeout_ms) / 1000),  # at least that long
            "STEADY_DRAIN_TIMEOUT_S": str(float(max_timeout_ms) / 1000),  # as is the drain
        }
    )
    settings = served_settings(env)
    assert settings.max_timeout_ms == float(max_timeout_ms or 60_000)  # default, or as set
    result = run_wrk("http://127.0.0.1:9", 64, 1, timeout_s=wrk_timeout_s(settings))
    assert result["ok"] == 5
    # Every answer the server gives, at its longest deadline or a little after, is still
    # one wrk records (latency percentiles and max), not one it drops as a timeout.
    assert _timeout_given(wrk_arguments) >= settings.max_timeout_ms / 1000 + 5


def _flood(**counts: int) -> dict[str, Any]:
    return {
        "connections": 64, "ok_per_s": 10.0, "throttled_share": 0.5, "paused_refusals": 0,
        "refused_after_body": 0, "unavailable": 0, "server_error": 0, "p50_ms": 1.0,
        "p99_ms": 2.0, "healthz_max_ms": 1.0, "probe_port_healthz_max_ms": 1.0,
        "frontend_cpu_us_per_answer": 100.0, "engine_cores": 0.5, "foreign_cores": 0.0,
        "connect_errors": 0, "read_errors": 0, "write_errors": 0, "timeouts": 0,
        **counts,
    }  # fmt: skip


def test_timeouts_are_their_own_column_and_socket_errors_count_writes() -> None:
    flood = _flood(connect_errors=1, read_errors=2, write_errors=4, timeouts=9)
    kill = {
        "readyz_503_after_s": 0.1, "ready_again_after_s": 5.0, "ok": 10, "unavailable": 3,
        "server_error": 0, "connect_errors": 1, "read_errors": 2, "write_errors": 4,
        "timeouts": 9, "max_ms": 12_000.0,
    }  # fmt: skip
    report = {
        "frontends": 1, "ready_s": 1.0, "resident_mb": 100.0, "wrk_timeout_s": 70,
        "floods": [flood], "engine_kill": kill,
    }  # fmt: skip
    text = markdown(report)
    header, _, row = (line for line in text.splitlines() if line.startswith("|"))
    columns = dict(
        zip(
            [cell.strip() for cell in header.split("|")],
            [cell.strip() for cell in row.split("|")],
            strict=True,
        )
    )
    assert columns["socket errors"] == "7"  # connect + read + write, no timeouts
    assert columns["wrk timeouts"] == "9"
    assert "7 socket errors, 9 wrk timeouts (over 70 s), slowest answer 12000 ms" in text
