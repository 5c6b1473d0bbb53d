"""A server of thousands of connections lifts its soft open-file limit to the hard one:
container runtimes now start it at 1024, and past that uvloop closes the connections it
accepts unanswered (a flood got nothing instead of 429s)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

PROBE = "from app.limits import lift_open_file_limit; print(lift_open_file_limit())"


def test_the_soft_open_file_limit_is_lifted_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = 256

    def start_low() -> None:  # in the child, before it runs: a container's small soft limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=start_low,
        check=True,
    )
    expected = hard if hard != resource.RLIM_INFINITY else max(low, 1 << 20)
    assert int(result.stdout) == expected > low


SERVE_PROBE = """
import resource, sys
import app.processes

def report_limit(settings):
    print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    return 0

app.processes.serve_processes = report_limit  # what `serve` would start its children from
from app.cli import main
sys.exit(main(["serve"]))
"""


def test_serve_lifts_the_limit_before_it_starts_any_child() -> None:
    """The helper alone working says nothing of `serve` calling it: the children inherit
    whatever limit the supervisor has when it spawns them."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    low = 256

    def start_low() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (low, hard))

    result = subprocess.run(
        [sys.executable, "-c", SERVE_PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=start_low,
        env={**os.environ, "STEADY_ENGINE": "process"},
    )
    assert result.returncode == 0, result.stderr
    expected = hard if hard != resource.RLIM_INFINITY else max(low, 1 << 20)
    assert int(result.stdout.strip().splitlines()[-1]) == expected > low
