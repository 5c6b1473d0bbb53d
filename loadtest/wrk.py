"""wrk driven from Python: `run_wrk` floods a URL in closed loop with `SCRIPT`
(loadtest/overload.lua: clients that resend as soon as they have any answer, 429s included)
and returns the script's RESULT counts. The overload and front-end cost benches call it from
any thread (it blocks until wrk exits); wrk itself comes from tools/ensure-tools.sh.

wrk's `--timeout` is not a client timeout: an answer that took longer is still counted by
the script (its status reaches `response()`), but it is left out of the latency histogram
(its percentiles and its max) and counted in `timeouts` instead; and every 2 s wrk adds one
to `timeouts` for each connection whose request has waited longer, so one slow request may
count several times. `wrk_timeout_s` therefore puts it above the longest deadline the server
serves with: every answer the server gives is in the latency figures, and `timeouts` counts
only requests the server held past any deadline it could have set.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

from app.settings import Settings

SCRIPT = Path(__file__).with_name("overload.lua")

# How far past the server's longest deadline (`max_timeout_ms`) wrk waits for an answer: the
# server answers a request whose deadline passed within milliseconds, unless its event loop
# stalls (seconds, under a flood of thousands of connections).
WRK_TIMEOUT_MARGIN_S = 10.0


def wrk_timeout_s(settings: Settings) -> int:
    """wrk's `--timeout` for a server running with `settings`, in whole seconds (wrk drops
    any fraction): past the longest deadline a request there can have."""
    return math.ceil(settings.max_timeout_ms / 1000 + WRK_TIMEOUT_MARGIN_S)


def wrk_command(
    url: str, connections: int, duration_s: float, path: str, timeout_s: int
) -> list[str]:
    threads = 1 if connections <= 64 else 2
    return [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s",
        "--timeout", f"{timeout_s}s", "-s", str(SCRIPT), url, "--", path,
    ]  # fmt: skip


def run_wrk(
    url: str, connections: int, duration_s: float, path: str = "/infer", *, timeout_s: int
) -> dict[str, Any]:
    """wrk flooding `path` (/infer or /v1/embeddings) with `SCRIPT`, waiting up to
    `timeout_s` for each answer (`wrk_timeout_s` of the server's settings); its RESULT
    counts."""
    command = wrk_command(url, connections, duration_s, path, timeout_s)
    output = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=duration_s + 60
    ).stdout
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result
