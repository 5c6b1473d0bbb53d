"""The comparison bench's phases (`python -m loadtest.bench`, whose docstring describes them),
each measured into a `PhaseOutcome`: the raw model in this process (`measure_raw`), and a
server started, warmed up, driven in closed loop and stopped (`measure_server`), with the
naive server's, TorchServe's and steadyserve's commands. The overhead and v2 benches run
`measure_server` / `measure_steadyserve` too. Call from the bench's main thread: each phase
blocks until it is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from app.dispatcher import default_thread_plan
from loadtest import torchserve_phase
from loadtest.bodies import LengthDistribution, sentence
from loadtest.cpuload import ForeignLoad
from loadtest.driver import ProgressPrinter, execute, run_event_loop
from loadtest.httpclient import Target
from loadtest.localserver import REPO_ROOT, free_port, http_status
from loadtest.minilm import MiniLM, configure_torch
from loadtest.proctree import tree_resident_mb
from loadtest.records import Mode, Recorder, RunConfig, RunResult
from loadtest.report import Summary, summarize
from loadtest.report_output import format_table, write_json
from loadtest.report_plots import write_plots
from loadtest.stages import Stage
from loadtest.torchserve_phase import TorchServeLayout

# How long the raw phase times single requests for its latency figures (at most).
RAW_SINGLE_REQUEST_S = 10.0


@dataclass
class PhaseOutcome:
    name: str
    description: str
    throughput_rps: float
    p50_ms: float | None
    p95_ms: float | None
    p99_ms: float | None
    error_rate: float
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def tail_ratio(self) -> float | None:
        if self.p50_ms is None or self.p99_ms is None or self.p50_ms <= 0:
            return None
        return self.p99_ms / self.p50_ms

    @classmethod
    def of(cls, name: str, description: str, summary: Summary, **details: Any) -> PhaseOutcome:
        latency = summary.latency_ms
        return cls(
            name=name,
            description=description,
            throughput_rps=summary.throughput_rps,
            p50_ms=latency.get("p50"),
            p95_ms=latency.get("p95"),
            p99_ms=latency.get("p99"),
            error_rate=summary.error_rate,
            details=details,
        )


def bench_sentences(count: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lengths = LengthDistribution("fixed", float(words))
    return [sentence(lengths.sample(rng), rng) for _ in range(count)]


def log(message: str) -> None:
    sys.stderr.write(f"[bench] {message}\n")
    sys.stderr.flush()


# -- phase 1: the raw model ---------------------------------------------------------------


def _time_batches(
    model: MiniLM, sentences: Sequence[str], batch_size: int, seconds: float
) -> tuple[array[float], array[float]]:
    """Run batches back to back for ``seconds`` (Rust tokenizer, as steadyserve); start and
    end time of each batch."""
    starts, ends = array("d"), array("d")
    position = 0
    give_up_at = time.monotonic() + seconds
    while time.monotonic() < give_up_at or len(ends) < 3:
        batch = [sentences[(position + i) % len(sentences)] for i in range(batch_size)]
        position += batch_size
        started = time.monotonic()
        model.embed_fast(batch)
        starts.append(started)
        ends.append(time.monotonic())
    return starts, ends


def measure_raw(
    options: argparse.Namespace, sentences: Sequence[str], out_dir: Path
) -> PhaseOutcome:
    configure_torch(options.threads)
    model = MiniLM.load(options.dtype)
    _time_batches(model, sentences, 8, 1.0)  # first calls pay one-off kernel setup
    sweep: dict[int, float] = {}
    for batch_size in options.batch_sizes:
        starts, ends = _time_batches(model, sentences, batch_size, options.sweep_seconds)
        sweep[batch_size] = batch_size * len(ends) / (ends[-1] - starts[0])
        log(f"raw sweep: batch {batch_size:4d} -> {sweep[batch_size]:8.1f} sentences/s")
    best = max(sweep, key=lambda size: sweep[size])
    batch = options.raw_batch
    log(
        f"raw: best batch size in the sweep {best}; measuring batch {batch} "
        f"for {options.duration_s:g} s"
    )
    foreign = ForeignLoad([os.getpid()])
    starts, ends = _time_batches(model, sentences, batch, options.duration_s)
    throughput = batch * len(ends) / (ends[-1] - starts[0])
    # Latency: single requests timed one by one. Giving every input of a batch the batch's
    # time would describe no request anyone sent.
    single_s = min(options.duration_s, RAW_SINGLE_REQUEST_S)
    log(f"raw: {throughput:.1f} sentences/s at batch {batch}; timing single requests")
    single_starts, single_ends = _time_batches(model, sentences, 1, single_s)
    foreign_cores = foreign.cores()
    recorder = Recorder()
    for started, ended in zip(single_starts, single_ends, strict=True):
        recorder.record(started, started, ended, 200, "", 0)
    result = RunResult(
        config=RunConfig(mode=Mode.CLOSED, stages=(Stage(single_s, 1, 1),)),
        recorder=recorder,
        started_at=single_starts[0],
        finished_at=single_ends[-1],
        scheduled_total=len(recorder),
        dispatch_lags=array("d"),
    )
    label = f"raw in-process, batch {batch}"
    summary = summarize(result, "in-process, batch 1", label)
    phase_dir = out_dir / "raw"
    write_json(summary, result, phase_dir / "report.json")
    write_plots(summary, result, phase_dir)
    print(format_table(summary), flush=True)
    outcome = PhaseOutcome.of(
        "raw",
        label,
        summary,
        raw_batch_size=batch,
        best_batch_size=best,
        best_batch_sentences_per_s=round(sweep[best], 1),
        latency_from="single requests (batch 1), timed one by one",
        single_request_rps=round(summary.throughput_rps, 1),
        foreign_cores=foreign_cores,
        sweep_sentences_per_s={str(k): round(v, 1) for k, v in sweep.items()},
    )
    # The reference the ratio to it is judged against (issue 7: the raw model at batch 64),
    # measured for the full duration; the sweep's best batch is reported beside it.
    outcome.throughput_rps = throughput
    return outcome


# -- phases 2 to 4: servers ---------------------------------------------------------------


def measure_server(
    name: str,
    command: list[str],
    env: dict[str, str],
    port: int,
    options: argparse.Namespace,
    payloads: Sequence[bytes],
    target: Target,
    out_dir: Path,
    layout: str = "",
    ready_url: str | None = None,
    cwd: Path = REPO_ROOT,
    own_process_group: bool = False,
) -> PhaseOutcome:
    """Start `command`, wait until `ready_url` (default: its /readyz) answers 200, drive it,
    stop it; `layout` (its thread layout) goes into the phase's description. A server whose
    launcher does not pass SIGTERM on to what it starts (TorchServe's) runs in its own
    process group, which is signalled as a whole."""
    phase_dir = out_dir / name
    phase_dir.mkdir(parents=True, exist_ok=True)
    log_path = phase_dir / "server.log"
    started = time.monotonic()
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=own_process_group,
        )

    def group_alive() -> bool:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(signal_number: int) -> None:
        if own_process_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal_number)
        else:
            process.send_signal(signal_number)

    def wait_stopped(timeout_s: float) -> None:
        """The server and, in its own group, everything it started have exited."""
        process.wait(timeout=timeout_s)
        give_up_at = time.monotonic() + timeout_s
        while own_process_group and group_alive():
            if time.monotonic() > give_up_at:
                raise subprocess.TimeoutExpired(command, timeout_s)
            time.sleep(0.1)  # polling the group: no handle to wait on its members

    try:
        ready_url = ready_url or f"http://127.0.0.1:{port}/readyz"
        give_up_at = started + options.ready_timeout_s
        while http_status(ready_url) != 200:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {log_path}")
            if time.monotonic() > give_up_at:
                raise TimeoutError(f"{name} not ready in {options.ready_timeout_s:g} s")
            time.sleep(0.2)  # polling the readiness endpoint
        ready_s = time.monotonic() - started
        rss_ready = tree_resident_mb(process.pid)
        log(f"{name}: ready in {ready_s:.1f} s, {rss_ready or 0:.0f} MB resident; warming up")
        warmup = RunConfig(
            mode=Mode.CLOSED,
            stages=(Stage(options.warmup_s, options.connections, options.connections),),
        )
        run_event_loop(lambda: execute(warmup, target, payloads))
        log(f"{name}: {options.connections} connections for {options.duration_s:g} s")
        config = RunConfig(
            mode=Mode.CLOSED,
            stages=(Stage(options.duration_s, options.connections, options.connections),),
            timeout_s=30.0,
        )
        progress = ProgressPrinter(sys.stderr, options.duration_s)
        foreign = ForeignLoad([os.getpid(), process.pid])
        result = run_event_loop(lambda: execute(config, target, payloads, progress))
        foreign_cores = foreign.cores()
        server_cores = foreign.cores_of(process.pid)
        rss_after = tree_resident_mb(process.pid)
    finally:
        if process.poll() is None or own_process_group:
            stop(signal.SIGTERM)
            try:
                wait_stopped(30)
            except subprocess.TimeoutExpired:
                stop(signal.SIGKILL)
                wait_stopped(10)
    description = f"{name}{layout}, {options.connections} connections"
    summary = summarize(result, target.path, description)
    write_json(summary, result, phase_dir / "report.json")
    write_plots(summary, result, phase_dir)
    print(format_table(summary), flush=True)
    return PhaseOutcome.of(
        name,
        description,
        summary,
        ready_s=round(ready_s, 1),
        resident_mb_ready=rss_ready,
        resident_mb_after=rss_after,
        generator_cpu_mean=round(summary.generator_cpu_mean, 3),
        foreign_cores=foreign_cores,
        server_cores=round(server_cores, 3),
        warnings=summary.warnings,
    )


def measure_naive(options: argparse.Namespace, payloads_for: Any, out_dir: Path) -> PhaseOutcome:
    port = free_port()
    target = Target.parse(f"http://127.0.0.1:{port}/infer")
    command = [
        sys.executable,
        "-m",
        "loadtest.naive_server",
        "--port",
        str(port),
        "--threads",
        str(options.threads),
        "--dtype",
        options.dtype,
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    layout = f" 1x{options.threads} threads"
    return measure_server(
        "naive", command, env, port, options, payloads_for(target), target, out_dir, layout
    )


def measure_torchserve(
    options: argparse.Namespace, payloads_for: Any, out_dir: Path
) -> PhaseOutcome:
    """TorchServe with batching (`loadtest/torchserve_phase.py`): --torchserve-workers
    workers sharing --threads torch threads, batches of up to --connections requests within
    --torchserve-delay."""
    workers = options.torchserve_workers
    layout = TorchServeLayout(
        inference_port=free_port(),
        management_port=free_port(),
        metrics_port=free_port(),
        batch_size=options.connections,
        max_batch_delay_ms=options.torchserve_delay_ms,
        workers=workers,
        threads_per_worker=max(1, options.threads // workers),
        dtype=options.dtype,
    )
    phase_dir = out_dir / "torchserve"
    phase_dir.mkdir(parents=True, exist_ok=True)
    command = torchserve_phase.prepare(layout, phase_dir)
    target = Target.parse(f"http://127.0.0.1:{layout.inference_port}{layout.inference_path}")
    description = (
        f" {workers}x{layout.threads_per_worker} threads, batch {layout.batch_size} "
        f"within {layout.max_batch_delay_ms} ms"
    )
    return measure_server(
        "torchserve",
        command,
        torchserve_phase.environment(layout, dict(os.environ)),
        layout.inference_port,
        options,
        payloads_for(target),
        target,
        out_dir,
        description,
        ready_url=layout.ready_url,
        cwd=phase_dir,
        own_process_group=True,
    )


def measure_steadyserve(
    options: argparse.Namespace,
    payloads_for: Any,
    out_dir: Path,
    name: str = "steadyserve",
    extra_env: dict[str, str] | None = None,
) -> PhaseOutcome:
    """steadyserve in its default layout for --threads CPUs, with --steady-env and then
    `extra_env` applied; its results go under `out_dir/name`."""
    port = free_port()
    target = Target.parse(f"http://127.0.0.1:{port}/infer")
    command = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    plan = default_thread_plan(options.threads)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        # Its default layout for --threads CPUs, from the server's own rule.
        "STEADY_DISPATCHER_THREADS": str(plan.compute_threads),
        "STEADY_TORCH_THREADS": str(plan.torch_intra_op),
        "STEADY_MODELS": json.dumps([{"name": "all-MiniLM-L6-v2", "dtype": options.dtype}]),
        "STEADY_LOG_LEVEL": "warning",
    }
    for assignment in options.steady_env:
        key, _, value = assignment.partition("=")
        env[key] = value
    env.update(extra_env or {})
    layout = f" {env['STEADY_DISPATCHER_THREADS']}x{env['STEADY_TORCH_THREADS']} threads"
    return measure_server(
        name, command, env, port, options, payloads_for(target), target, out_dir, layout
    )
