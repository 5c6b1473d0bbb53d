"""A server of thousands of connections lifts its soft open-file limit to the hard one:
container runtimes now start it at 1024, and past that uvloop closes the connections it
accepts unanswered (a flood got nothing instead of 429s)."""

from __future__ import annotations

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
