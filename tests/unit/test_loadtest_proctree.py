"""`stop_process` (loadtest/proctree.py): a server that ignores SIGTERM is still stopped."""

from __future__ import annotations

import subprocess
import sys

from loadtest.proctree import stop_process

IGNORES_SIGTERM = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_a_process_that_ignores_sigterm_is_killed_after_the_timeout() -> None:
    process = subprocess.Popen([sys.executable, "-c", IGNORES_SIGTERM], stdout=subprocess.PIPE)
    try:
        assert process.stdout is not None
        assert process.stdout.readline() == b"ready\n"  # SIGTERM is ignored from here on
        stop_process(process, timeout_s=0.2)
        assert process.returncode == -9  # SIGKILL: the drain never ended by itself
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
