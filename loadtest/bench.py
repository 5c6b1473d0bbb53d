"""The comparison bench behind ``make bench``: raw model limit vs naive server vs TorchServe vs
steadyserve.

Four phases, back to back in one invocation, all with the bundled all-MiniLM-L6-v2 and the
same dtype, on ~12-word sentences, one per request, each using the same CPUs (``--threads``,
default: the CPUs this process may use):

1. **raw**: the model in this process, no HTTP, ``--threads`` torch threads, tokenized by the
   Rust tokenizer directly (as steadyserve does). Batches of ``--raw-batch`` (64) run for
   the full duration: that throughput is what steadyserve/raw divides by (issue 7's target:
   >= 0.8x the raw in-process model at batch 64). A short sweep beforehand finds the batch
   size with the most sentences per second, reported beside it (the machine's ceiling).
   Its latencies are of single requests (batch 1) timed one by one, each its own record.
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
plus bench.json under --out. This module is the command line and the comparison; the phases
themselves are measured by `loadtest/bench_phases.py`.

``python -m loadtest.bench [--duration 20s] [--connections 64] [--threads N]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

from app.telemetry.cgroup import available_cpus
from loadtest.bench_phases import (
    PhaseOutcome,
    bench_sentences,
    log,
    measure_naive,
    measure_raw,
    measure_steadyserve,
    measure_torchserve,
)
from loadtest.httpclient import Target
from loadtest.localserver import REPO_ROOT
from loadtest.minilm import DTYPES
from loadtest.stages import parse_duration

PHASES = ("raw", "naive", "torchserve", "steadyserve")


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
        if name == "steadyserve/raw" and (raw := outcomes.get("raw")) is not None:
            line += f"   (raw at batch {raw.details.get('raw_batch_size', '?')})"
        lines.append(line)
    raw = outcomes.get("raw")
    if raw is not None and "best_batch_size" in raw.details:
        best_rps = raw.details["best_batch_sentences_per_s"]
        lines.append(
            f"raw's best batch in the sweep: {raw.details['best_batch_size']} at "
            f"{best_rps:.1f} sentences/s (steadyserve at "
            f"{_figure(_ratio(rate('steadyserve'), best_rps), 2)} of it; no target)"
        )
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
    parser.add_argument(
        "--raw-batch",
        type=int,
        default=64,
        help="Raw phase: the batch size measured for the duration, which steadyserve/raw "
        "divides by (issue 7's target is against batch 64).",
    )
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
        log(f"phase {phase}")
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
            log(f"phase {phase} failed: {error}")
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
