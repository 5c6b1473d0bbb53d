"""Front-end CPU per request, measured against an engine with a null model
(`loadtest/null_engine.py`): `steadyserve serve`'s own process tree with one front end and
the real engine process, whose model's forward pass is zeros. The front end does everything
it does in production, the engine round trip over ZeroMQ (encode, send, receive, decode)
and the engine's status stream included; wrk at 64 connections; the CPU seconds of the
front-end process alone (not the engine's, the supervisor's or wrk's) divided by the answers
it gave. Once with every request admitted (no backlog), once with every request refused
before its body is read (a published backlog over the delay budget). Each run must be all of
its kind (no refusal or 5xx among the admitted, no 200 among the refused), else the figure
would price a mix and the bench fails. `--path` picks the route flooded: /infer (the
default) or OpenAI's /v1/embeddings.

    python -m loadtest.frontend_cost --duration 10s [--path /v1/embeddings]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from app.limits import lift_open_file_limit
from loadtest.localserver import REPO_ROOT, free_port, get_json, served_settings
from loadtest.overload_server import frontend_pids
from loadtest.proctree import cpu_seconds, stop_process
from loadtest.stages import parse_duration
from loadtest.wrk import run_wrk, wrk_timeout_s

# (name, the null engine's published backlog, whether every request is to be admitted)
CASES = (("admitted", 0.0, True), ("refused before the body", 10_000.0, False))

# The engine process imports torch and warms every shape up before the front end is ready.
READY_TIMEOUT_S = 180.0

WHAT = (
    "One front end of `steadyserve serve`'s tree against the real engine process over "
    "ZeroMQ, whose model computes nothing (loadtest/null_engine.py); the front-end "
    "process's CPU only."
)

# A token-bucket refill no flood from one machine can drain, so that in the admitted case
# only the null engine decides (default: 100,000 tokens/s, within reach of wrk's rate).
UNLIMITED_RATE_PER_S = "1e9"


PATHS = ("/infer", "/v1/embeddings")


def check_answers(result: dict[str, Any], admitted: bool, path: str) -> None:
    """Raise unless every answer in wrk's `result` is of the case measured: 2xx when
    `admitted`, refusals (429/503) when not."""
    if result["other"]:  # 4xx: the bodies were refused, and the figure would mean nothing
        raise RuntimeError(f"{result['other']} answers to {path} were neither 2xx nor refusals")
    if admitted:
        wrong = {k: result[k] for k in ("throttled", "unavailable", "server_error") if result[k]}
        expected = "all admitted, but some were refused or failed"
    else:
        wrong = {"ok": result["ok"]} if result["ok"] else {}
        expected = "all refused, but some were answered 2xx"
    if wrong:
        raise RuntimeError(
            f"answers to {path} were to be {expected} ({wrong}): the CPU per answer would "
            "price a mix of the two"
        )


def measure(
    backlog_ms: float, duration_s: float, log_path: Path, path: str = "/infer", *, admitted: bool
) -> tuple[float, int]:
    """(microseconds of front-end CPU per answer, answers), flooding `path`: the CPU of
    the one front-end process (`WHAT`)."""
    port = free_port()
    command = [
        sys.executable, "-m", "loadtest.null_engine", "--port", str(port),
        "--backlog-ms", str(backlog_ms),
    ]  # fmt: skip
    # What one refusal costs: refused connections must resend as fast as wrk can, not be
    # paused for their Retry-After as `steadyserve serve` does by default.
    overrides = {
        "STEADY_REFUSED_READ_PAUSE_S": "0",
        "STEADY_RATE_LIMIT_PER_S": UNLIMITED_RATE_PER_S,
    }
    timeout_s = wrk_timeout_s(served_settings(overrides))
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            env={**os.environ, **overrides},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        give_up_at = time.monotonic() + READY_TIMEOUT_S
        while get_json(f"{url}/readyz", timeout=1)[0] != 200:
            if time.monotonic() > give_up_at or server.poll() is not None:
                raise RuntimeError(f"the null-engine server did not start; see {log_path}")
            time.sleep(0.1)  # polling the readiness endpoint
        frontends = frontend_pids(server.pid, url)
        if len(frontends) != 1:
            raise RuntimeError(f"expected one front-end process, found {frontends}")
        run_wrk(url, 64, 2, path, timeout_s=timeout_s)  # warm up
        before = cpu_seconds(frontends[0])
        result = run_wrk(url, 64, duration_s, path, timeout_s=timeout_s)
        spent = cpu_seconds(frontends[0]) - before
    finally:
        stop_process(server)
    check_answers(result, admitted, path)
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
    rows = [WHAT, "", f"| {options.path} requests | front-end CPU per answer | answers |"]
    rows.append("|---|---:|---:|")
    for name, backlog_ms, admitted in CASES:
        duration_s = parse_duration(options.duration)
        log = out / "null-engine.log"
        cost_us, answers = measure(backlog_ms, duration_s, log, options.path, admitted=admitted)
        rows.append(f"| {name} | {cost_us:.0f} us | {answers} |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
