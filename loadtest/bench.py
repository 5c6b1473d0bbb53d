"""The comparison bench behind ``make bench``: raw model limit vs naive server vs TorchServe vs
steadyserve.

Four phases, back to back in one invocation, all with the bundled all-MiniLM-L6-v2 and the
same dtype, on ~12-word sentences, one per request, each using the same CPUs (``--threads``,
default: the CPUs this process may use):

1. **raw**: the model in this process, no HTTP, ``--threads`` torch threads, tokenized by the
   Rust tokenizer directly (as steadyserve does). A short sweep finds the batch size with
   the most sentences per second; that batch size then runs for the full duration: its
   throughput is the ceiling any server on this machine could approach. Its latencies are
   of single requests (batch 1) timed one by one, each its own record.
2. **naive**: `loadtest.naive_server` in a child process: one worker computing one request
   at a time with ``--threads`` torch threads (the server a user writes first), driven by
   the generator in closed loop with N connections for the duration.
3. **torchserve**: TorchServe with server-side batching (``loadtest/torchserve_phase.py``):
   one Python worker with ``--threads`` torch threads computing what the raw phase computes,
   batches of up to N requests formed within ``--torchserve-delay``, driven the same way.
   It needs Java (``tools/ensure-tools.sh --bench``).
4. **steadyserve**: ``python -m app.cli serve`` in a child process with its own default
   layout for ``--threads`` CPUs (front ends, dispatcher threads x torch threads per
   dispatcher thread; on 2 CPUs one front end and 1 x 1), driven the same way.
   ``--steady-env`` overrides settings.

It prints req/s, p50/p95/p99 and the ratios (steadyserve/raw, steadyserve/naive,
steadyserve/torchserve, p99/p50 for each), and writes each phase's report.json and plots
plus bench.json under --out.

``python -m loadtest.bench [--duration 20s] [--connections 64] [--threads N]``
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
import urllib.error
import urllib.request
from array import array
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.dispatcher import default_thread_plan
from app.telemetry.cgroup import available_cpus
from loadtest import torchserve_phase
from loadtest.bodies import LengthDistribution, sentence
from loadtest.driver import ProgressPrinter, execute, run_event_loop
from loadtest.httpclient import Target
from loadtest.minilm import DTYPES, MiniLM, configure_torch
from loadtest.proctree import cpu_seconds, descendants, tree_resident_mb
from loadtest.records import Mode, Recorder, RunConfig, RunResult
from loadtest.report import Summary, summarize
from loadtest.report_output import format_table, write_json
from loadtest.report_plots import write_plots
from loadtest.stages import Stage, parse_duration
from loadtest.torchserve_phase import TorchServeLayout

REPO_ROOT = Path(__file__).resolve().parents[1]
# How long the raw phase times single requests for its latency figures (at most).
RAW_SINGLE_REQUEST_S = 10.0
PHASES = ("raw", "naive", "torchserve", "steadyserve")


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


_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _system_busy_s() -> float:
    """CPU seconds all processes have used since boot (Linux /proc/stat)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in fields[:8])
    return (user + nice + system + irq + softirq + steal) / _TICKS_PER_S


class ForeignLoad:
    """Cores used by processes other than the bench and its server (with the server's
    children: `steadyserve serve` runs an engine and front ends) during a phase, and the
    cores the server itself used.

    On a shared 2-core machine other work slows every phase, torch most of all (its
    threads wait for each other when one is descheduled), so each phase reports it.
    """

    def __init__(self, pids: Sequence[int]) -> None:
        # Once each: the server is also a descendant of the bench's own process.
        self._pids = list(dict.fromkeys(p for pid in pids for p in descendants(pid)))
        self._started = time.monotonic()
        self._busy = _system_busy_s()
        self._cpu = {pid: self._cpu_s(pid) for pid in self._pids}

    @staticmethod
    def _cpu_s(pid: int) -> float:
        try:
            return cpu_seconds(pid)
        except (OSError, ValueError, IndexError):
            return 0.0

    def _own_s(self, pids: Sequence[int]) -> float:
        return sum(self._cpu_s(pid) - self._cpu[pid] for pid in pids)

    def cores(self) -> float | None:
        try:
            busy = _system_busy_s() - self._busy
        except (OSError, ValueError, IndexError):
            return None
        wall = max(time.monotonic() - self._started, 1e-9)
        return max(busy - self._own_s(self._pids), 0.0) / wall

    def cores_of(self, pid: int) -> float:
        """Cores `pid` and its descendants (as found at the start) used."""
        tree = [p for p in self._pids if p in descendants(pid)]
        wall = max(time.monotonic() - self._started, 1e-9)
        return self._own_s(tree) / wall


def _log(message: str) -> None:
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
        _log(f"raw sweep: batch {batch_size:4d} -> {sweep[batch_size]:8.1f} sentences/s")
    best = max(sweep, key=lambda size: sweep[size])
    _log(f"raw: best batch size {best}; measuring it for {options.duration_s:g} s")
    foreign = ForeignLoad([os.getpid()])
    starts, ends = _time_batches(model, sentences, best, options.duration_s)
    throughput = best * len(ends) / (ends[-1] - starts[0])
    # Latency: single requests timed one by one. Giving every input of a batch the batch's
    # time would describe no request anyone sent.
    single_s = min(options.duration_s, RAW_SINGLE_REQUEST_S)
    _log(f"raw: {throughput:.1f} sentences/s at batch {best}; timing single requests")
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
    label = f"raw in-process, batch {best}"
    summary = summarize(result, "in-process, batch 1", label)
    phase_dir = out_dir / "raw"
    write_json(summary, result, phase_dir / "report.json")
    write_plots(summary, result, phase_dir)
    print(format_table(summary), flush=True)
    outcome = PhaseOutcome.of(
        "raw",
        label,
        summary,
        best_batch_size=best,
        latency_from="single requests (batch 1), timed one by one",
        single_request_rps=round(summary.throughput_rps, 1),
        foreign_cores=foreign_cores,
        sweep_sentences_per_s={str(k): round(v, 1) for k, v in sweep.items()},
    )
    outcome.throughput_rps = throughput  # the ceiling: the best batch size
    return outcome


# -- phases 2 and 3: servers --------------------------------------------------------------


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
        while _http_status(ready_url) != 200:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode}; see {log_path}")
            if time.monotonic() > give_up_at:
                raise TimeoutError(f"{name} not ready in {options.ready_timeout_s:g} s")
            time.sleep(0.2)  # polling the readiness endpoint
        ready_s = time.monotonic() - started
        rss_ready = tree_resident_mb(process.pid)
        _log(f"{name}: ready in {ready_s:.1f} s, {rss_ready or 0:.0f} MB resident; warming up")
        warmup = RunConfig(
            mode=Mode.CLOSED,
            stages=(Stage(options.warmup_s, options.connections, options.connections),),
        )
        run_event_loop(lambda: execute(warmup, target, payloads))
        _log(f"{name}: {options.connections} connections for {options.duration_s:g} s")
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
    port = _free_port()
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
        inference_port=_free_port(),
        management_port=_free_port(),
        metrics_port=_free_port(),
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
    port = _free_port()
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


# -- the comparison -----------------------------------------------------------------------


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _figure(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def comparison_table(outcomes: dict[str, PhaseOutcome]) -> tuple[str, dict[str, float | None]]:
    lines = [
        f"{'phase':<72} {'req/s':>9} {'p50 ms':>8} {'p95 ms':>8} {'p99 ms':>8} "
        f"{'p99/p50':>8} {'errors':>8}"
    ]
    for outcome in outcomes.values():
        lines.append(
            f"{outcome.description:<72} {outcome.throughput_rps:9.1f} "
            f"{_figure(outcome.p50_ms):>8} {_figure(outcome.p95_ms):>8} "
            f"{_figure(outcome.p99_ms):>8} {_figure(outcome.tail_ratio, 2):>8} "
            f"{outcome.error_rate:8.2%}"
        )

    def rate(name: str) -> float | None:
        outcome = outcomes.get(name)
        return outcome.throughput_rps if outcome is not None else None

    ratios: dict[str, float | None] = {
        "steadyserve/raw": _ratio(rate("steadyserve"), rate("raw")),
        "steadyserve/naive": _ratio(rate("steadyserve"), rate("naive")),
        "steadyserve/torchserve": _ratio(rate("steadyserve"), rate("torchserve")),
    }
    for outcome in outcomes.values():
        ratios[f"{outcome.name} p99/p50"] = outcome.tail_ratio
    targets = {
        "steadyserve/raw": 0.8,
        "steadyserve/naive": 4.0,
        "steadyserve/torchserve": 1.6,
        "steadyserve p99/p50": 1.5,
    }
    lines.append("")
    for name, value in ratios.items():
        line = f"{name:<24} {_figure(value, 2):>6}"
        if name in targets and value is not None:
            goal = targets[name]
            met = value <= goal if "p99/p50" in name else value >= goal
            sign = "<=" if "p99/p50" in name else ">="
            line += f"   (target {sign} {goal:g}: {'met' if met else 'NOT met'})"
        lines.append(line)
    return "\n".join(lines), ratios


def markdown_summary(
    outcomes: dict[str, PhaseOutcome], ratios: dict[str, float | None], command: str
) -> str:
    """The comparison as a Markdown table, ready for docs/BENCHMARKS.md."""
    lines = [
        f"`{command}`",
        "",
        "| phase | req/s | p50 ms | p95 ms | p99 ms | p99/p50 | errors | other processes' CPU |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for outcome in outcomes.values():
        foreign = outcome.details.get("foreign_cores")
        lines.append(
            f"| {outcome.description} | {outcome.throughput_rps:.1f} | "
            f"{_figure(outcome.p50_ms)} | {_figure(outcome.p95_ms)} | "
            f"{_figure(outcome.p99_ms)} | {_figure(outcome.tail_ratio, 2)} | "
            f"{outcome.error_rate:.2%} | "
            f"{'-' if foreign is None else f'{foreign:.2f} cores'} |"
        )
    lines.append("")
    lines.append(
        "Ratios: " + ", ".join(f"{name} **{_figure(value, 2)}**" for name, value in ratios.items())
    )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--duration", default="20s", help="Measured time of each phase.")
    parser.add_argument("--warmup", default="3s", help="Unmeasured load before each server phase.")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument(
        "--threads",
        type=int,
        default=available_cpus(),
        help="torch threads of the raw phase and of the naive server's one worker (default: "
        "the CPUs available, which steadyserve divides among its dispatcher threads).",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    parser.add_argument("--words", type=int, default=12, help="Words per sentence.")
    parser.add_argument("--phases", default=",".join(PHASES), help="Subset, comma-separated.")
    parser.add_argument("--batch-sizes", default="1,4,8,16,32,64,128", help="Raw phase's sweep.")
    parser.add_argument("--sweep", default="2s", help="Raw phase: time per batch size.")
    parser.add_argument("--ready-timeout", default="300s")
    parser.add_argument(
        "--torchserve-delay",
        default="10ms",
        help="TorchServe's maxBatchDelay: how long it waits to fill a batch.",
    )
    parser.add_argument(
        "--torchserve-workers",
        type=int,
        default=1,
        help="TorchServe's Python workers; they share --threads torch threads.",
    )
    parser.add_argument(
        "--steady-env",
        action="append",
        default=[],
        help="Extra KEY=VALUE for steadyserve (e.g. STEADY_MAX_BATCH_SIZE=64).",
    )
    parser.add_argument("--out", help="Folder for the results (default loadtest/results/...).")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    options.duration_s = parse_duration(options.duration)
    options.warmup_s = parse_duration(options.warmup)
    options.sweep_seconds = parse_duration(options.sweep)
    options.ready_timeout_s = parse_duration(options.ready_timeout)
    options.torchserve_delay_ms = round(parse_duration(options.torchserve_delay) * 1000)
    options.batch_sizes = [int(size) for size in options.batch_sizes.split(",")]
    phases = [phase.strip() for phase in options.phases.split(",") if phase.strip()]
    unknown = set(phases) - set(PHASES)
    if unknown:
        sys.stderr.write(f"unknown phases {sorted(unknown)}; choose from {PHASES}\n")
        return 2
    out_dir = Path(
        options.out or REPO_ROOT / "loadtest/results" / time.strftime("bench-%Y%m%d-%H%M%S")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    sentences = bench_sentences(1000, options.words, options.seed)

    def payloads_for(target: Target) -> list[bytes]:
        return [
            target.post_bytes(json.dumps({"inputs": text}, separators=(",", ":")).encode())
            for text in sentences
        ]

    outcomes: dict[str, PhaseOutcome] = {}
    failures: dict[str, str] = {}
    for phase in phases:
        _log(f"phase {phase}")
        try:
            if phase == "raw":
                outcomes[phase] = measure_raw(options, sentences, out_dir)
            elif phase == "naive":
                outcomes[phase] = measure_naive(options, payloads_for, out_dir)
            elif phase == "torchserve":
                outcomes[phase] = measure_torchserve(options, payloads_for, out_dir)
            else:
                outcomes[phase] = measure_steadyserve(options, payloads_for, out_dir)
        except (RuntimeError, TimeoutError, OSError) as error:
            failures[phase] = str(error)
            _log(f"phase {phase} failed: {error}")
    table, ratios = comparison_table(outcomes)
    print("\n" + table, flush=True)
    busy = {
        name: round(outcome.details["foreign_cores"], 2)
        for name, outcome in outcomes.items()
        if (outcome.details.get("foreign_cores") or 0.0) > 0.2
    }
    if busy:
        print(
            f"WARNING: other processes used CPU during {sorted(busy)} (cores: {busy}); "
            "on a small machine that slows the phases unevenly: rerun when it is idle.",
            flush=True,
        )
    arguments = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m loadtest.bench", *arguments])
    (out_dir / "summary.md").write_text(markdown_summary(outcomes, ratios, command))
    document = {
        "command": command,
        "settings": {
            "duration_s": options.duration_s,
            "connections": options.connections,
            "threads": options.threads,
            "dtype": options.dtype,
            "words": options.words,
            "cpus": os.cpu_count(),
        },
        "phases": {name: asdict(outcome) for name, outcome in outcomes.items()},
        "ratios": ratios,
        "failures": failures,
    }
    (out_dir / "bench.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"results in {out_dir}/", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
