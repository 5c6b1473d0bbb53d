"""A server of thousands of connections lifts its soft open-file limit to the hard one:
container runtimes now start it at 1024, and past that uvloop closes the connections it
accepts unanswered (a flood got nothing instead of 429s)."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

LOW = 256
PROBE = "from app.limits import lift_open_file_limit; print(lift_open_file_limit())"
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


def soft_limit_reported_by(code: str) -> int:
    """Run `code` in a child started with a container's small soft limit (`LOW`); the last
    line it prints."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]

    def start_low() -> None:  # in the child, before it runs
        resource.setrlimit(resource.RLIMIT_NOFILE, (LOW, hard))

    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=start_low,
        env={**os.environ, "STEADY_ENGINE": "process"},
    )
    assert result.returncode == 0, result.stderr
    return int(result.stdout.strip().splitlines()[-1])


def expected_limit() -> int:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    return hard if hard != resource.RLIM_INFINITY else max(LOW, 1 << 20)


def test_the_soft_open_file_limit_is_lifted_to_the_hard_one() -> None:
    assert soft_limit_reported_by(PROBE) == expected_limit() > LOW


def test_serve_lifts_the_limit_before_it_starts_any_child() -> None:
    """The helper alone working says nothing of `serve` calling it: the children inherit
    whatever limit the supervisor has when it spawns them."""
    assert soft_limit_reported_by(SERVE_PROBE) == expected_limit() > LOW
