"""The batch client's bench: one JSONL file through one steadyserve, adaptive vs fixed.

One server (the bundled model, as in ``loadtest.bench``) is started and warmed up once;
then ``steadyserve batch`` runs the same file of short sentences, back to back, as:

1. **adaptive**: the client as shipped, AIMD between 1 and its default ceiling (128);
2. **adaptive-1000**: AIMD with a ceiling of 1,000, to show what the AIMD does when only
   the server's 429s hold it back;
3. **fixed-64** and **fixed-1000**: ``--fixed-concurrency`` at 64 and at 1,000 (the
   orchestrator pattern behind the incidents). These still honour Retry-After: only the
   concurrency policy differs, so the comparison is of that alone.

For each: time to finish, lines answered, lines/s, 2xx goodput (answers per second), 429
count and share of requests, p99 of 2xx attempts (the client's log histogram, within
12 %), retries, the client's peak resident memory and the CPU other processes used
meanwhile. Target (issue 10): adaptive finishes at least as fast as the best fixed setting,
with at most 1 % of its requests answered 429. Times compare only between phases that did
the whole job (the client exited 0 with every line answered); otherwise the verdict is
INVALID and the bench exits 1, as `loadtest.bench` does when a phase fails.

``python -m loadtest.batch_bench [--lines 100000] [--phases adaptive,fixed-64,fixed-1000]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from loadtest.bench_phases import bench_sentences
from loadtest.cpuload import own_cpu_s, system_busy_s
from loadtest.localserver import REPO_ROOT, free_port, http_status
from loadtest.proctree import stop_process

# phase -> (--concurrency, adaptive); None: the CLI's default ceiling
PHASES: dict[str, tuple[int | None, bool]] = {
    "adaptive": (None, True),
    "adaptive-1000": (1000, True),
    "fixed-64": (64, False),
    "fixed-1000": (1000, False),
}


@dataclass(frozen=True)
class BatchOutcome:
    phase: str
    wall_s: float
    lines: int  # in the input
    lines_ok: int  # answered
    lines_per_s: float
    goodput_2xx_per_s: float
    requests: int
    responses_2xx: int
    responses_429: int
    share_429: float
    retries: int
    p99_ms: float | None
    concurrency_final: int
    concurrency_highest: int
    client_peak_mb: float
    foreign_cores: float
    exit_code: int


def _log(message: str) -> None:
    sys.stderr.write(f"[batch-bench] {message}\n")
    sys.stderr.flush()


def write_input(path: Path, lines: int, words: int, seed: int) -> None:
    sentences = bench_sentences(min(lines, 5000), words, seed)
    with path.open("w") as file:
        for number in range(lines):
            text = f"{sentences[number % len(sentences)]} ({number})"
            file.write(json.dumps({"id": number, "inputs": text}) + "\n")


@dataclass(frozen=True)
class ClientRun:
    exit_code: int
    wall_s: float
    own_cpu_s: float  # this bench, the client and the server's whole process tree
    foreign_cores: float  # what other processes used meanwhile


def run_client(command: list[str], server: int) -> ClientRun:
    """Run the batch client `command` to its end against the server `server` (its pid);
    the CPU other processes used meanwhile leaves out the server's engine and front ends,
    its children (`cpuload.own_cpu_s`)."""
    busy_before, own_before = system_busy_s(), own_cpu_s(server)
    started = time.monotonic()
    client = subprocess.Popen(command, cwd=REPO_ROOT)
    exit_code = client.wait()  # reaped: its CPU is counted among this process's children
    wall = time.monotonic() - started
    own = own_cpu_s(server) - own_before
    foreign = max(0.0, system_busy_s() - busy_before - own) / wall
    return ClientRun(exit_code, wall, own, foreign)


def run_phase(
    phase: str, url: str, source: Path, out_dir: Path, options: argparse.Namespace, server: int
) -> BatchOutcome:
    concurrency, adaptive = PHASES[phase]
    output = out_dir / f"{phase}.jsonl"
    for stale in (output, out_dir / f"{phase}.errors.jsonl"):
        stale.unlink(missing_ok=True)
    summary_path = out_dir / f"{phase}.summary.json"
    command = [sys.executable, "-m", "app.cli", "batch", str(source), "--url", url]
    command += ["--out", str(output), "--summary-json", str(summary_path), "--progress", "lines"]
    command += ["--max-retries", "100", "--seed", str(options.seed)]
    if concurrency is not None:
        command += ["--concurrency", str(concurrency)]
    if not adaptive:
        command += ["--fixed-concurrency"]
    _log(f"{phase}: {' '.join(command[2:])}")
    run = run_client(command, server)
    wall = run.wall_s
    summary: dict[str, Any] = json.loads(summary_path.read_text())
    statuses = {int(k): v for k, v in summary["statuses"].items()}
    ok = sum(n for s, n in statuses.items() if 200 <= s < 300)
    throttled = statuses.get(429, 0)
    requests = int(summary["requests"])
    return BatchOutcome(
        phase=phase,
        wall_s=round(wall, 2),
        lines=options.lines,
        lines_ok=int(summary["lines_ok"]),
        lines_per_s=round(summary["lines_ok"] / wall, 1),
        goodput_2xx_per_s=round(ok / wall, 1),
        requests=requests,
        responses_2xx=ok,
        responses_429=throttled,
        share_429=round(throttled / requests, 4) if requests else 0.0,
        retries=int(summary["retries"]),
        p99_ms=summary["latency_p99_ms"],
        concurrency_final=int(summary["concurrency_final"]),
        concurrency_highest=int(summary["concurrency_highest"]),
        # The client's own VmHWM: wait4's ru_maxrss would include this process's memory,
        # which Linux carries over into a child across fork and exec.
        client_peak_mb=summary["peak_resident_mb"] or 0.0,
        foreign_cores=round(run.foreign_cores, 2),
        exit_code=run.exit_code,
    )


def markdown_table(outcomes: list[BatchOutcome]) -> str:
    head = (
        "| phase | time to finish (s) | lines answered | exit | lines/s | 2xx/s | requests "
        "| 429s | 429 share | retries | p99 (ms) | concurrency (final/highest) "
        "| client peak MB | other CPU (cores) |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| {o.phase} | {o.wall_s} | {o.lines_ok:,}/{o.lines:,} | {o.exit_code} "
        f"| {o.lines_per_s} | {o.goodput_2xx_per_s} | {o.requests:,} "
        f"| {o.responses_429:,} | {o.share_429:.2%} | {o.retries:,} | {o.p99_ms} "
        f"| {o.concurrency_final}/{o.concurrency_highest} | {o.client_peak_mb} "
        f"| {o.foreign_cores} |"
        for o in outcomes
    ]
    return "\n".join([head, *rows])


def incomplete(outcome: BatchOutcome) -> str | None:
    """Why a phase's time cannot be compared with another's: its client failed, or left
    lines unanswered (a phase that dropped lines finishes sooner); None when it did the
    whole job."""
    if outcome.exit_code != 0:
        return f"{outcome.phase}: the client exited {outcome.exit_code}"
    if outcome.lines_ok != outcome.lines:
        return f"{outcome.phase}: {outcome.lines_ok:,} of {outcome.lines:,} lines answered"
    return None


def verdict_problems(outcomes: list[BatchOutcome]) -> list[str]:
    """Why the verdict is invalid: a phase it compares (adaptive, fixed-*) is incomplete."""
    compared = [o for o in outcomes if o.phase == "adaptive" or o.phase.startswith("fixed")]
    return [problem for o in compared if (problem := incomplete(o)) is not None]


def verdict(outcomes: list[BatchOutcome]) -> str:
    by_phase = {o.phase: o for o in outcomes}
    adaptive = by_phase.get("adaptive")
    fixed = [o for o in outcomes if o.phase.startswith("fixed")]
    if adaptive is None or not fixed:
        return "verdict: needs the adaptive phase and at least one fixed phase"
    if problems := verdict_problems(outcomes):
        why = "; ".join(problems)
        return f"verdict INVALID: times compare only phases that answered every line ({why})"
    best = min(fixed, key=lambda o: o.wall_s)
    fast_enough = adaptive.wall_s <= best.wall_s
    polite = adaptive.share_429 <= 0.01
    return (
        f"adaptive {adaptive.wall_s} s vs best fixed ({best.phase}) {best.wall_s} s: "
        f"{'met' if fast_enough else 'NOT met'}; adaptive 429 share {adaptive.share_429:.2%} "
        f"(target <= 1%): {'met' if polite else 'NOT met'}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtest.batch_bench", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--lines", type=int, default=100_000)
    parser.add_argument("--words", type=int, default=8, help="words per sentence")
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)
    parser.add_argument("--out", type=Path, help="default loadtest/results/batch-bench-...")
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    phases = [p.strip() for p in options.phases.split(",") if p.strip()]
    if unknown := set(phases) - set(PHASES):
        sys.stderr.write(f"unknown phases {sorted(unknown)}; choose from {list(PHASES)}\n")
        return 2
    out_dir: Path = options.out or REPO_ROOT / "loadtest/results" / time.strftime(
        "batch-bench-%Y%m%d-%H%M%S"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    source = out_dir / "input.jsonl"
    write_input(source, options.lines, options.words, options.seed)
    warmup = out_dir / "warmup.jsonl"
    write_input(warmup, 2000, options.words, options.seed + 1)
    port = free_port()
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "STEADY_TORCH_THREADS": str(options.threads),
        "STEADY_MODELS": json.dumps([{"name": "all-MiniLM-L6-v2", "dtype": options.dtype}]),
        "STEADY_LOG_LEVEL": "warning",
    }
    command = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    with (out_dir / "server.log").open("wb") as log:
        server = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    outcomes: list[BatchOutcome] = []
    try:
        give_up_at = time.monotonic() + options.ready_timeout_s
        while http_status(f"{url}/readyz") != 200:
            if server.poll() is not None or time.monotonic() > give_up_at:
                raise RuntimeError(f"server not ready; see {out_dir / 'server.log'}")
            time.sleep(0.2)  # polling the readiness endpoint
        _log("server ready; warming up with 2,000 lines")
        subprocess.run(
            [sys.executable, "-m", "app.cli", "batch", str(warmup), "--url", url, "--out",
             str(out_dir / "warmup.out.jsonl"), "--progress", "off"],
            cwd=REPO_ROOT, check=False,
        )  # fmt: skip
        for phase in phases:
            outcomes.append(run_phase(phase, url, source, out_dir, options, server.pid))
            _log(f"{phase}: {outcomes[-1]}")
    finally:
        stop_process(server, timeout_s=60)
    table = markdown_table(outcomes)
    arguments = sys.argv[1:] if argv is None else argv
    command_line = " ".join(["python -m loadtest.batch_bench", *arguments])
    text = f"`{command_line}`, {options.lines:,} lines\n\n{table}\n\n{verdict(outcomes)}\n"
    print("\n" + text, flush=True)
    (out_dir / "summary.md").write_text(text)
    document = {"command": command_line, "lines": options.lines, "cpus": os.cpu_count()}
    document["phases"] = [asdict(o) for o in outcomes]
    (out_dir / "batch_bench.json").write_text(json.dumps(document, indent=2) + "\n")
    print(f"results in {out_dir}/", flush=True)
    return 1 if verdict_problems(outcomes) else 0


if __name__ == "__main__":
    raise SystemExit(main())
