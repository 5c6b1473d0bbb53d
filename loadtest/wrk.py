"""wrk driven from Python: `run_wrk` floods a URL in closed loop with `SCRIPT`
(loadtest/overload.lua: clients that resend as soon as they have any answer, 429s included)
and returns the script's RESULT counts. The overload and front-end cost benches call it from
any thread (it blocks until wrk exits); wrk itself comes from tools/ensure-tools.sh.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).with_name("overload.lua")


def run_wrk(url: str, connections: int, duration_s: float, path: str = "/infer") -> dict[str, Any]:
    """wrk flooding `path` (/infer or /v1/embeddings) with `SCRIPT`; its RESULT counts."""
    threads = 1 if connections <= 64 else 2
    command = [
        "wrk", f"-t{threads}", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "10s",
        "-s", str(SCRIPT), url, "--", path,
    ]  # fmt: skip
    output = subprocess.run(
        command, capture_output=True, text=True, check=True, timeout=duration_s + 60
    ).stdout
    line = next(line for line in output.splitlines() if line.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result
