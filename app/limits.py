"""The open-file limit a server (or a load generator) of thousands of connections needs.

Container runtimes now start processes with a soft limit of 1024 descriptors (containerd
2, Docker 29). A front end holds up to `STEADY_MAX_CONNECTIONS` (8192) connections; past
~1,000, uvloop meets EMFILE and closes the connections it accepts unanswered, so a flood
that should get 429s gets nothing. Called on the main thread before children start (they
inherit it).
"""

from __future__ import annotations

import contextlib
import resource


def lift_open_file_limit() -> int:
    """Raise the soft limit on open files to the hard one (to 2^20 when unlimited); the
    soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < wanted:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
