"""`make bench`'s overload phases: one `steadyserve serve` (default settings) under closed-loop
connection floods whose clients resend at once after a 429, then its engine killed with
SIGKILL under load.

Right after the first (lowest) connection count, requests at 0.7x and 3x its goodput in an
open loop. For each connection count it reports 2xx goodput (and its ratio to the first, lowest
count), the answers by class, latency percentiles of all answers (under a flood nearly all
are 429s), the slowest `/healthz` seen while the flood ran (probed every 100 ms), the CPU the
front ends and the engine used per answer, and the cores other processes used meanwhile (the
machine is shared: a figure taken with other work running says so). wrk drives the load
(`tools/ensure-tools.sh` installs it); everything runs on 127.0.0.1 and stops by itself.

    python -m loadtest.overload_bench --connections 64,1500,5000 --duration 15s
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.limits import lift_open_file_limit
from loadtest.bench_phases import bench_sentences
from loadtest.cpuload import system_busy_s
from loadtest.driver import execute, run_event_loop
from loadtest.httpclient import Target
from loadtest.localserver import REPO_ROOT, free_port
from loadtest.proctree import (
    command_line,
    cpu_seconds,
    descendants,
    stop_process,
    tree_resident_mb,
)
from loadtest.records import Mode, RunConfig
from loadtest.stages import Stage, parse_duration
from loadtest.stats import nearest_rank, p99_sample_note

SCRIPT = Path(__file__).with_name("overload.lua")


def _log(message: str) -> None:
    sys.stderr.write(f"[overload] {message}\n")
    sys.stderr.flush()


def _get(url: str, timeout: float = 5.0) -> tuple[int | None, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None, {}


PAUSED_REFUSALS = "steadyserve_refusals_paused_total"
REJECTED = "steadyserve_rejected_total"


@dataclass(frozen=True)
class RefusalCounts:
    """The server's own refusal counters (its /metrics), compared before and after a run.

    `paused`: refusals answered by pausing their connection, i.e. how many of the run's
    refusals its clients resent faster than admissions paid for
    (`app/api/refusal_budget.py`). `after_body`: refusals of requests that were let in
    before the body was read, then refused by the token bucket or the engine (a model
    label; shedding from headers has none): each cost the front end a body, a parse and
    a tokenization, and the client as long."""

    paused: float
    after_body: float

    def __sub__(self, earlier: RefusalCounts) -> RefusalCounts:
        return RefusalCounts(self.paused - earlier.paused, self.after_body - earlier.after_body)


IDLE_GAUGES = ("steadyserve_inflight_requests", "steadyserve_queue_depth")


def _metrics_text(base_url: str) -> str:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=30) as response:
        text: str = response.read().decode()
    return text


def wait_until_idle(base_url: str, timeout_s: float = 60.0) -> None:
    """Until nothing is in flight or queued: what a previous phase left in the server (a
    flood's requests whose clients are gone, refused or expired later) is counted in the
    phase it belongs to, not in the next one's refusals."""
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at:
        levels = [
            float(value)
            for name, _, value in (
                line.rpartition(" ") for line in _metrics_text(base_url).splitlines()
            )
            if name in IDLE_GAUGES
        ]
        if levels and not any(levels):
            return
        time.sleep(0.05)
    raise RuntimeError(f"{base_url} still had work in flight after {timeout_s:g} s")


def refusal_counts(base_url: str) -> RefusalCounts:
    """The counters once the server is idle (`wait_until_idle`)."""
    wait_until_idle(base_url)
    text = _metrics_text(base_url)
    paused: float | None = None
    after_body = 0.0
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == PAUSED_REFUSALS:
            paused = float(value)
        elif name.startswith(REJECTED + "{") and 'model=""' not in name:
            after_body += float(value)
    if paused is None:
        raise RuntimeError(f"{PAUSED_REFUSALS} is not in {base_url}/metrics")
    return RefusalCounts(paused, after_body)


@dataclass(frozen=True)
class Server:
    process: subprocess.Popen[bytes]
    base_url: str
    probe_url: str  # the supervisor's probe port (STEADY_HEALTH_PORT)

    def engine_pid(self) -> int | None:
        engine = _get(f"{self.base_url}/readyz")[1].get("engine")
        return int(engine["pid"]) if isinstance(engine, dict) else None

    def frontend_pids(self) -> list[int]:
        engine = self.engine_pid()
        return [
            pid
            for pid in descendants(self.process.pid)
            if pid not in (self.process.pid, engine) and "spawn_main" in command_line(pid)
        ]

    def wait_ready(self, timeout_s: float) -> float:
        started = time.monotonic()
        while _get(f"{self.base_url}/readyz", timeout=2)[0] != 200:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}")
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"not ready in {timeout_s:g} s")
            time.sleep(0.1)  # polling the readiness endpoint
        return time.monotonic() - started


class HealthProbe:
    """GET /healthz every 100 ms on a new connection each time, as a kubelet does."""

    def __init__(self, base_url: str) -> None:
        self._url = f"{base_url}/healthz"
        self._stop = threading.Event()
        self.latencies_ms: list[float] = []
        self.failures = 0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            started = time.perf_counter()
            status, _ = _get(self._url, timeout=10)
            if status != 200:
                self.failures += 1
            self.latencies_ms.append((time.perf_counter() - started) * 1000)

    def __enter__(self) -> HealthProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


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


def measure_flood(server: Server, connections: int, duration_s: float) -> dict[str, Any]:
    engine = server.engine_pid() or 0
    frontends = server.frontend_pids()
    refusals_before = refusal_counts(server.base_url)  # waits until the server is idle
    # CPU readings and the wall clock share one span, from the end of that wait to the end
    # of the flood: cores = CPU / wall would otherwise count the wait's CPU (or the scrape
    # and wait after the flood) over a wall clock that leaves them out.
    cpu_before = {pid: cpu_seconds(pid) for pid in [engine, *frontends]}
    busy_before, own_before = system_busy_s(), _own_cpu_s(server)
    wall_started = time.monotonic()
    with HealthProbe(server.base_url) as probe, HealthProbe(server.probe_url) as probe_port:
        result = run_wrk(server.base_url, connections, duration_s)
    wall = time.monotonic() - wall_started
    frontend_cpu = sum(cpu_seconds(p) - cpu_before[p] for p in frontends)
    engine_cpu = cpu_seconds(engine) - cpu_before[engine]
    busy, own = system_busy_s() - busy_before, _own_cpu_s(server) - own_before
    refusals = refusal_counts(server.base_url) - refusals_before
    answers = sum(result[k] for k in ("ok", "throttled", "unavailable", "server_error", "other"))
    seconds = result["seconds"]
    healthz = sorted(probe.latencies_ms)
    on_probe_port = sorted(probe_port.latencies_ms)
    return {
        "connections": connections,
        **result,
        "ok_per_s": result["ok"] / seconds,
        "answers_per_s": answers / seconds,
        "throttled_share": result["throttled"] / answers if answers else 0.0,
        "paused_refusals": refusals.paused,
        "refused_after_body": refusals.after_body,
        "healthz_max_ms": healthz[-1] if healthz else None,
        "healthz_p99_ms": nearest_rank(healthz, 0.99),
        "healthz_samples": len(healthz),
        "healthz_failures": probe.failures,
        "probe_port_healthz_max_ms": on_probe_port[-1] if on_probe_port else None,
        "probe_port_failures": probe_port.failures,
        "frontend_cpu_us_per_answer": 1e6 * frontend_cpu / answers if answers else None,
        "engine_cores": engine_cpu / wall,
        "frontend_cores": frontend_cpu / wall,
        "foreign_cores": max(0.0, busy - own) / wall,
    }


def _own_cpu_s(server: Server) -> float:
    """CPU of this bench, the server's tree and finished children (wrk)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    mine = resource.getrusage(resource.RUSAGE_SELF)
    tree = sum(cpu_seconds(pid) for pid in descendants(server.process.pid))
    return tree + children.ru_utime + children.ru_stime + mine.ru_utime + mine.ru_stime


def measure_engine_kill(server: Server, duration_s: float) -> dict[str, Any]:
    """SIGKILL the engine a third of the way into a 64-connection run; time until /readyz
    says so and until a new engine is ready; what the clients got meanwhile."""
    engine = server.engine_pid()
    assert engine is not None
    outcome: dict[str, Any] = {}
    load = threading.Thread(
        target=lambda: outcome.update(run_wrk(server.base_url, 64, duration_s)), daemon=True
    )
    load.start()
    time.sleep(duration_s / 3)  # let the load reach a steady state before the kill
    killed_at = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    while _get(f"{server.base_url}/readyz", timeout=2)[0] == 200:
        time.sleep(0.005)  # polling /readyz for the moment it reports the loss
    noticed_s = time.monotonic() - killed_at
    ready_again_s = noticed_s + server.wait_ready(120)
    load.join(timeout=duration_s + 120)
    return {
        "killed_engine_pid": engine,
        "new_engine_pid": server.engine_pid(),
        "readyz_503_after_s": round(noticed_s, 3),
        "ready_again_after_s": round(ready_again_s, 2),
        **outcome,
    }


def measure_open_loop(server: Server, rate: float, duration_s: float) -> dict[str, Any]:
    """Requests at a fixed rate whatever the answers (open loop, latency from the scheduled
    time, so a stalled server cannot hide it): what admitted requests' tail does at this
    load, and what share is refused."""
    target = Target.parse(f"{server.base_url}/infer")
    payloads = [
        target.post_bytes(json.dumps({"inputs": text}).encode())
        for text in bench_sentences(500, 12, seed=1)
    ]
    config = RunConfig(
        mode=Mode.OPEN,
        stages=(Stage(duration_s, rate, rate),),
        connections=1024,
        timeout_s=30.0,
    )
    refusals_before = refusal_counts(server.base_url)
    result = run_event_loop(lambda: execute(config, target, payloads))
    refusals = refusal_counts(server.base_url) - refusals_before
    recorder = result.recorder
    admitted = [
        (recorder.done[i] - recorder.scheduled[i]) * 1000
        for i in range(len(recorder))
        if recorder.status[i] == 200
    ]
    statuses = [int(status) for status in recorder.status]
    return {
        "rate": round(rate, 1),
        "sent": len(statuses),
        "ok": statuses.count(200),
        "throttled": statuses.count(429),
        "paused_refusals": refusals.paused,
        "refused_after_body": refusals.after_body,
        "other": len(statuses) - statuses.count(200) - statuses.count(429),
        "admitted_p50_ms": nearest_rank(admitted, 0.50),
        "admitted_p99_ms": nearest_rank(admitted, 0.99),
        "admitted_samples": len(admitted),
    }


def _run_open_loops(
    server: Server, capacity: float, duration_s: float, report: dict[str, Any]
) -> None:
    for share in (0.7, 3.0):
        _log(f"open loop at {share:g}x the first flood's goodput ({capacity:.0f}/s)")
        report.setdefault("open_loop", []).append(
            {"share": share, **measure_open_loop(server, share * capacity, duration_s)}
        )
        server.wait_ready(60)


def start_server(port: int, env: dict[str, str], log_path: Path) -> Server:
    probe_port = free_port()
    full_env = {**os.environ, "HF_HUB_OFFLINE": "1", "STEADY_HEALTH_PORT": str(probe_port), **env}
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)],
            cwd=REPO_ROOT,
            env=full_env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    return Server(process, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{probe_port}")


def markdown(report: dict[str, Any]) -> str:
    floods = report["floods"]
    base = floods[0]["ok_per_s"] or 1.0
    rows = [
        "| connections | 2xx/s | vs first | 429 share | refusals that paused | "
        "refused after the body | 503 | 5xx | "
        "socket errors | "
        "p50 / p99 ms (all answers) | /healthz max ms: traffic port / probe port | "
        "front-end CPU us/answer | engine cores | other processes' cores |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f in floods:
        errors = f["connect_errors"] + f["read_errors"] + f["write_errors"] + f["timeouts"]
        rows.append(
            f"| {f['connections']} | {f['ok_per_s']:.0f} | {f['ok_per_s'] / base:.2f} | "
            f"{f['throttled_share']:.1%} | {f['paused_refusals']:.0f} | "
            f"{f['refused_after_body']:.0f} | {f['unavailable']} | "
            f"{f['server_error']} | {errors} | "
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
            f"other 5xx, {kill['read_errors'] + kill['connect_errors']} socket errors, "
            f"slowest answer {kill['max_ms']:.0f} ms.",
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
            "floods": [],
        }
        run_wrk(server.base_url, 64, 3)  # warm the connections and the compute estimates
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
