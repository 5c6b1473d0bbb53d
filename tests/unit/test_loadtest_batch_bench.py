"""The batch client's bench (loadtest/batch_bench.py): what it counts as the server's CPU.

`steadyserve serve` is a supervisor whose engine and front ends are its children; the
bench took only the supervisor's own CPU as the server's, so the engine's and front ends'
showed up as "other CPU (cores)". Here a stand-in server (a parent process whose child
burns a known amount of CPU while the client runs) and a stand-in client; no real server.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.batch_bench import run_client

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
