"""`make bench`'s overload phases: one `steadyserve serve` (default settings) under closed-loop
connection floods whose clients resend at once after a 429, then its engine killed with
SIGKILL under load.

Right after the first (lowest) connection count, requests at 0.7x and 3x its goodput in an
open loop. For each connection count it reports 2xx goodput (and its ratio to the first, lowest
count), the answers by class, latency percentiles of all answers (under a flood nearly all
are 429s; wrk waits for each past the server's longest deadline, so none is left out), socket
errors and wrk's timeouts apart, the slowest `/healthz` seen while the flood ran (probed
every 100 ms), the CPU the
front ends and the engine used per answer, and the cores other processes used meanwhile (the
machine is shared: a figure taken with other work running says so). wrk drives the load
(`tools/ensure-tools.sh` installs it); everything runs on 127.0.0.1 and stops by itself.

This module is the command line and the summary table; the server is started and read by
`loadtest/overload_server.py`, and measured by `loadtest/overload_measure.py`.

    python -m loadtest.overload_bench --connections 64,1500,5000 --duration 15s
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from app.limits import lift_open_file_limit
from loadtest.localserver import REPO_ROOT, free_port
from loadtest.overload_measure import measure_engine_kill, measure_flood, measure_open_loop
from loadtest.overload_server import Server, start_server
from loadtest.proctree import stop_process, tree_resident_mb
from loadtest.stages import parse_duration
from loadtest.stats import p99_sample_note
from loadtest.wrk import run_wrk


def _log(message: str) -> None:
    sys.stderr.write(f"[overload] {message}\n")
    sys.stderr.flush()


def _run_open_loops(
    server: Server, capacity: float, duration_s: float, report: dict[str, Any]
) -> None:
    for share in (0.7, 3.0):
        _log(f"open loop at {share:g}x the first flood's goodput ({capacity:.0f}/s)")
        report.setdefault("open_loop", []).append(
            {"share": share, **measure_open_loop(server, share * capacity, duration_s)}
        )
        server.wait_ready(60)


def socket_errors(result: dict[str, Any]) -> int:
    """wrk's connect, read and write errors; not its timeouts, which are no socket's error
    (`loadtest/wrk.py`: a request unanswered for `--timeout`, counted every 2 s)."""
    return int(result["connect_errors"] + result["read_errors"] + result["write_errors"])


def markdown(report: dict[str, Any]) -> str:
    floods = report["floods"]
    base = floods[0]["ok_per_s"] or 1.0
    rows = [
        "| connections | 2xx/s | vs first | 429 share | refusals that paused | "
        "refused after the body | 503 | 5xx | "
        "socket errors | wrk timeouts | "
        "p50 / p99 ms (all answers) | /healthz max ms: traffic port / probe port | "
        "front-end CPU us/answer | engine cores | other processes' cores |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in floods:
        rows.append(
            f"| {f['connections']} | {f['ok_per_s']:.0f} | {f['ok_per_s'] / base:.2f} | "
            f"{f['throttled_share']:.1%} | {f['paused_refusals']:.0f} | "
            f"{f['refused_after_body']:.0f} | {f['unavailable']} | "
            f"{f['server_error']} | {socket_errors(f)} | {f['timeouts']} | "
            f"{f['p50_ms']:.1f} / {f['p99_ms']:.1f} | {f['healthz_max_ms'] or 0:.1f} / "
            f"{f['probe_port_healthz_max_ms'] or 0:.1f} | "
            f"{f['frontend_cpu_us_per_answer'] or 0:.0f} | {f['engine_cores']:.2f} | "
            f"{f['foreign_cores']:.2f} |"
        )
    opened = report.get("open_loop", [])
    if opened:
        lines_open = [
            "",
            "| open loop | req/s sent | 2xx | 429 | refusals that paused | "
            "refused after the body | other | admitted p50 / p99 ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for run in opened:
            lines_open.append(
                f"| {run['share']:g}x goodput | {run['rate']:.0f} | {run['ok']} | "
                f"{run['throttled']} | {run['paused_refusals']:.0f} | "
                f"{run['refused_after_body']:.0f} | {run['other']} | "
                f"{run['admitted_p50_ms'] or 0:.1f} / "
                f"{run['admitted_p99_ms'] or 0:.1f}{p99_sample_note(run['admitted_samples'])} |"
            )
        rows += lines_open
    kill = report.get("engine_kill")
    lines = [
        f"Server: `steadyserve serve`, {report['frontends']} front end(s), ready in "
        f"{report['ready_s']:.1f} s, {report['resident_mb']:.0f} MB resident (all processes).",
        "",
        *rows,
    ]
    if kill:
        lines += [
            "",
            f"Engine SIGKILL under 64 connections: /readyz 503 after "
            f"{kill['readyz_503_after_s']} s, ready again after {kill['ready_again_after_s']} s; "
            f"clients got {kill['ok']} 2xx, {kill['unavailable']} 503, {kill['server_error']} "
            f"other 5xx, {socket_errors(kill)} socket errors, {kill['timeouts']} wrk "
            f"timeouts (over {report['wrk_timeout_s']} s), slowest answer "
            f"{kill['max_ms']:.0f} ms.",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.overload_bench")
    parser.add_argument("--connections", default="64,1500,5000")
    parser.add_argument("--duration", default="15s", help="Each flood.")
    parser.add_argument("--kill-duration", default="30s", help="The engine-kill run; 0 skips.")
    parser.add_argument(
        "--open-duration", default="15s", help="Each open-loop run (0.7x and 3x); 0 skips."
    )
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server.")
    parser.add_argument("--out", help="Folder for results (default loadtest/results/...).")
    options = parser.parse_args(argv)
    if shutil.which("wrk") is None:
        parser.error("wrk is not installed (tools/ensure-tools.sh installs it)")
    out = Path(options.out or REPO_ROOT / "loadtest" / "results" / time.strftime(
        "%Y%m%d-%H%M%S-overload"))  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    lift_open_file_limit()
    env = dict(item.split("=", 1) for item in options.env)
    server = start_server(free_port(), env, out / "server.log")
    try:
        ready_s = server.wait_ready(300)
        report: dict[str, Any] = {
            "env": env,
            "ready_s": ready_s,
            "resident_mb": tree_resident_mb(server.process.pid),
            "frontends": len(server.frontend_pids()),
            "wrk_timeout_s": server.wrk_timeout_s,
            "floods": [],
        }
        # Warm the connections and the compute estimates.
        run_wrk(server.base_url, 64, 3, timeout_s=server.wrk_timeout_s)
        open_s = parse_duration(options.open_duration)
        for index, connections in enumerate(int(c) for c in options.connections.split(",")):
            _log(f"{connections} connections for {options.duration}")
            flood = measure_flood(server, connections, parse_duration(options.duration))
            report["floods"].append(flood)
            _log(json.dumps(flood))
            server.wait_ready(60)
            if index == 0 and open_s > 0:
                # Sized from the first flood and run before the larger ones, whose
                # aftermath (thousands of connections closing, paused clients) would
                # otherwise be measured as the open loop's tail.
                _run_open_loops(server, flood["ok_per_s"], open_s, report)
        report["resident_mb_after"] = tree_resident_mb(server.process.pid)
        kill_s = parse_duration(options.kill_duration)
        if kill_s > 0:
            _log("engine SIGKILL under 64 connections")
            report["engine_kill"] = measure_engine_kill(server, kill_s)
    finally:
        stop_process(server.process, timeout_s=60)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    summary = markdown(report)
    (out / "summary.md").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
