"""Front-end CPU per request, measured with the null engine (`loadtest/null_engine.py`):
one front end, wrk at 64 connections, CPU seconds of the front-end process divided by the
answers it gave. Once with every request admitted (a null engine with no backlog), once with
every request refused before its body is read (a backlog over the delay budget). `--path`
picks the route flooded: /infer (the default) or OpenAI's /v1/embeddings.

    python -m loadtest.frontend_cost --duration 10s [--path /v1/embeddings]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

from app.limits import lift_open_file_limit
from loadtest.bench import REPO_ROOT, _free_port
from loadtest.overload_bench import _get, run_wrk
from loadtest.proctree import cpu_seconds, stop_process
from loadtest.stages import parse_duration

CASES = (("admitted", 0.0), ("refused before the body", 10_000.0))


PATHS = ("/infer", "/v1/embeddings")


def measure(
    backlog_ms: float, duration_s: float, log_path: Path, path: str = "/infer"
) -> tuple[float, int]:
    """(microseconds of front-end CPU per answer, answers), flooding `path`."""
    port = _free_port()
    command = [
        sys.executable, "-m", "loadtest.null_engine", "--port", str(port),
        "--backlog-ms", str(backlog_ms),
    ]  # fmt: skip
    # What one refusal costs: refused connections must resend as fast as wrk can, not be
    # paused for their Retry-After as `steadyserve serve` does by default.
    env = {**os.environ, "STEADY_REFUSED_READ_PAUSE_S": "0"}
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        url = f"http://127.0.0.1:{port}"
        give_up_at = time.monotonic() + 60
        while _get(f"{url}/readyz", timeout=1)[0] != 200:
            if time.monotonic() > give_up_at or server.poll() is not None:
                raise RuntimeError(f"null-engine front end did not start; see {log_path}")
            time.sleep(0.1)  # polling the readiness endpoint
        run_wrk(url, 64, 2, path)  # warm up
        before = cpu_seconds(server.pid)
        result = run_wrk(url, 64, duration_s, path)
        spent = cpu_seconds(server.pid) - before
    finally:
        stop_process(server)
    if result["other"]:  # 4xx: the bodies were refused, and the figure would mean nothing
        raise RuntimeError(f"{result['other']} answers to {path} were neither 2xx nor refusals")
    answers = sum(result[k] for k in ("ok", "throttled", "unavailable", "server_error", "other"))
    return 1e6 * spent / max(answers, 1), answers


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.frontend_cost")
    parser.add_argument("--duration", default="10s")
    parser.add_argument("--path", default="/infer", choices=PATHS)
    parser.add_argument("--out", default=str(REPO_ROOT / "loadtest" / "results"))
    options = parser.parse_args(argv)
    lift_open_file_limit()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [f"| {options.path} requests | front-end CPU per answer | answers |"]
    rows.append("|---|---:|---:|")
    for name, backlog_ms in CASES:
        duration_s = parse_duration(options.duration)
        log = out / "null-engine.log"
        cost_us, answers = measure(backlog_ms, duration_s, log, options.path)
        rows.append(f"| {name} | {cost_us:.0f} us | {answers} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
