"""The batch client's bench (loadtest/batch_bench.py): what it counts as the server's CPU,
and which phases its verdict compares.

`steadyserve serve` is a supervisor whose engine and front ends are its children; the
bench took only the supervisor's own CPU as the server's, so the engine's and front ends'
showed up as "other CPU (cores)". Here a stand-in server (a parent process whose child
burns a known amount of CPU while the client runs) and a stand-in client; no real server.
The verdict compared times alone, so a phase whose client failed or dropped lines could
win; it is judged here on outcomes given by hand.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loadtest.batch_bench import BatchOutcome, run_client, verdict, verdict_problems

BURN_S = 1.0

# The server's child: once the client says go, burn BURN_S of CPU, then say done.
BURNER = f"""
import os, sys, time
go, done = sys.argv[1], sys.argv[2]
while not os.path.exists(go):
    time.sleep(0.01)
start = time.process_time()
while time.process_time() - start < {BURN_S}:
    pass
open(done, "w").close()
time.sleep(600)
"""

# The server: starts the burner as its child, says its pid, and idles.
SERVER = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], *sys.argv[2:]])
print(child.pid, flush=True)
time.sleep(600)
"""

# The client: lets the burner go and waits until it is done.
CLIENT = """
import os, sys, time
open(sys.argv[1], "w").close()
while not os.path.exists(sys.argv[2]):
    time.sleep(0.01)
"""


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[int, Path, Path]]:
    """(the stand-in server's pid, the go file, the done file)."""
    go, done = tmp_path / "go", tmp_path / "done"
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER, BURNER, str(go), str(done)], stdout=subprocess.PIPE
    )
    assert process.stdout is not None
    burner = int(process.stdout.readline())
    try:
        yield process.pid, go, done
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(burner, signal.SIGKILL)
        process.kill()
        process.wait()


def test_the_servers_children_count_as_the_server_not_as_other_processes(
    server: tuple[int, Path, Path],
) -> None:
    pid, go, done = server
    run = run_client([sys.executable, "-c", CLIENT, str(go), str(done)], pid)
    assert run.exit_code == 0
    # The burner's CPU was the server's (its child's), not another process's: what other
    # processes used is what the system was busy with less this.
    assert run.own_cpu_s >= BURN_S


def _outcome(phase: str, wall_s: float, **changes: Any) -> BatchOutcome:
    fields: dict[str, Any] = {
        "phase": phase, "wall_s": wall_s, "lines": 1000, "lines_ok": 1000,
        "lines_per_s": 1000 / wall_s, "goodput_2xx_per_s": 1000 / wall_s, "requests": 1000,
        "responses_2xx": 1000, "responses_429": 0, "share_429": 0.0, "retries": 0,
        "p99_ms": 10.0, "concurrency_final": 64, "concurrency_highest": 64,
        "client_peak_mb": 40.0, "foreign_cores": 0.0, "exit_code": 0,
    }  # fmt: skip
    return BatchOutcome(**{**fields, **changes})


@pytest.mark.parametrize(
    ("failed", "why"),
    [
        ({"exit_code": 1}, "adaptive: the client exited 1"),
        ({"lines_ok": 900}, "adaptive: 900 of 1,000 lines answered"),
    ],
)
def test_a_phase_that_did_not_answer_every_line_cannot_win(
    failed: dict[str, Any], why: str
) -> None:
    # Faster than fixed-64, but only because it did less of the job.
    outcomes = [_outcome("adaptive", 5.0, **failed), _outcome("fixed-64", 10.0)]
    text = verdict(outcomes)
    assert text.startswith("verdict INVALID") and why in text
    assert "met" not in text.replace("INVALID", "")
    assert verdict_problems(outcomes) == [why]  # and the bench exits 1


def test_an_incomplete_fixed_phase_invalidates_the_comparison_too() -> None:
    outcomes = [_outcome("adaptive", 10.0), _outcome("fixed-1000", 5.0, lines_ok=999)]
    assert verdict(outcomes).startswith("verdict INVALID")
    # adaptive-1000 is shown, not compared.
    shown = [_outcome("adaptive", 5.0), _outcome("adaptive-1000", 1.0, exit_code=1)]
    assert not verdict_problems([*shown, _outcome("fixed-64", 10.0)])


def test_complete_phases_are_compared_by_time() -> None:
    text = verdict([_outcome("adaptive", 5.0), _outcome("fixed-64", 10.0)])
    assert text.startswith("adaptive 5.0 s vs best fixed (fixed-64) 10.0 s: met")
