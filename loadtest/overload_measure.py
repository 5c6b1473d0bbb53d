"""The overload bench's measurements against a running `Server` (loadtest/overload_server.py):
`measure_flood`, a wrk flood at one connection count with the server's CPU, refusals and
/healthz meanwhile; `measure_engine_kill`, the engine SIGKILLed under load; and
`measure_open_loop`, requests at a fixed rate whatever the answers. Each returns its figures
as a dict for report.json; call from the bench's main thread (each blocks while it runs).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Any

from loadtest.bench_phases import bench_sentences
from loadtest.cpuload import own_cpu_s, system_busy_s
from loadtest.driver import execute, run_event_loop
from loadtest.httpclient import Target
from loadtest.localserver import get_json
from loadtest.overload_server import HealthProbe, Server, refusal_counts
from loadtest.proctree import cpu_seconds
from loadtest.records import Mode, RunConfig
from loadtest.stages import Stage
from loadtest.stats import nearest_rank
from loadtest.wrk import run_wrk


def measure_flood(server: Server, connections: int, duration_s: float) -> dict[str, Any]:
    engine = server.engine_pid() or 0
    frontends = server.frontend_pids()
    refusals_before = refusal_counts(server.base_url)  # waits until the server is idle
    # CPU readings and the wall clock share one span, from the end of that wait to the end
    # of the flood: cores = CPU / wall would otherwise count the wait's CPU (or the scrape
    # and wait after the flood) over a wall clock that leaves them out.
    cpu_before = {pid: cpu_seconds(pid) for pid in [engine, *frontends]}
    busy_before, own_before = system_busy_s(), own_cpu_s(server.process.pid)
    wall_started = time.monotonic()
    with HealthProbe(server.base_url) as probe, HealthProbe(server.probe_url) as probe_port:
        result = run_wrk(server.base_url, connections, duration_s, timeout_s=server.wrk_timeout_s)
    wall = time.monotonic() - wall_started
    frontend_cpu = sum(cpu_seconds(p) - cpu_before[p] for p in frontends)
    engine_cpu = cpu_seconds(engine) - cpu_before[engine]
    busy = system_busy_s() - busy_before
    own = own_cpu_s(server.process.pid) - own_before
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


def measure_engine_kill(server: Server, duration_s: float) -> dict[str, Any]:
    """SIGKILL the engine a third of the way into a 64-connection run; time until /readyz
    says so and until a new engine is ready; what the clients got meanwhile."""
    engine = server.engine_pid()
    assert engine is not None
    outcome: dict[str, Any] = {}
    load = threading.Thread(
        target=lambda: outcome.update(
            run_wrk(server.base_url, 64, duration_s, timeout_s=server.wrk_timeout_s)
        ),
        daemon=True,
    )
    load.start()
    time.sleep(duration_s / 3)  # let the load reach a steady state before the kill
    killed_at = time.monotonic()
    os.kill(engine, signal.SIGKILL)
    while get_json(f"{server.base_url}/readyz", timeout=2)[0] == 200:
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
