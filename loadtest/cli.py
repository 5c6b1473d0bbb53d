"""Command line: ``python -m loadtest run ...`` (also ``steadyserve bench ...``).

Subcommands:

- ``run`` (the default when the first argument is an option): one load test with a table,
  a JSON report, plots and an optional SLA verdict. Exit status 0 when the verdict passes
  (or none was asked for), 1 when it fails, 2 for a usage error (an input file that cannot
  be read included), 3 when the run passed but its files could not be written (the table
  and verdict are printed first, whatever happens to the files).
- ``hey-summary``: read ``hey -o csv`` output and print the same table (used by hey.sh).
- ``compare`` (or ``bench``): the raw vs naive vs steadyserve comparison, `loadtest.bench`;
  ``steadyserve bench compare`` reads better than ``steadyserve bench bench``.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from app.limits import lift_open_file_limit
from loadtest.bodies import BodyPool, LengthDistribution, generated_bodies, jsonl_bodies
from loadtest.driver import ProgressPrinter, execute, run_event_loop
from loadtest.httpclient import Target
from loadtest.records import ERROR_KINDS, Mode, Recorder, RunConfig, RunResult
from loadtest.report import Summary, judge, summarize
from loadtest.report_output import format_table, write_json
from loadtest.report_plots import write_plots
from loadtest.stages import Arrival, Stage, parse_duration, parse_stages

DEFAULT_RESULTS_DIR = Path("loadtest/results")
EXIT_PASS, EXIT_FAIL, EXIT_USAGE, EXIT_FILES = 0, 1, 2, 3


@dataclass(frozen=True)
class Outcome:
    summary: Summary
    result: RunResult
    files: list[Path]
    exit_code: int


def build_payloads(options: argparse.Namespace, target: Target) -> list[bytes]:
    extra: dict[str, Any] = json.loads(options.extra_json) if options.extra_json else {}
    if options.timeout_ms is not None:
        extra["timeout_ms"] = options.timeout_ms
    pool: BodyPool
    if options.body_jsonl is not None:
        pool = jsonl_bodies(Path(options.body_jsonl), extra)
    else:
        pool = generated_bodies(
            options.body_count,
            LengthDistribution.parse(options.words),
            options.inputs_per_request,
            options.seed,
            extra,
        )
    headers = dict(_parse_header(text) for text in options.header)
    return [target.post_bytes(body, headers) for body in pool.bodies]


def _parse_header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"header {text!r} is not NAME: VALUE")
    return name.strip(), value.strip()


def build_config(options: argparse.Namespace) -> RunConfig:
    mode = Mode(options.mode)
    stages: list[Stage]
    if options.stages:
        stages = parse_stages(options.stages)
    else:
        level = options.rate if mode is Mode.OPEN else options.concurrency
        if level is None:
            flag = "--rate" if mode is Mode.OPEN else "--concurrency"
            raise ValueError(f"{mode.value} loop needs {flag} or --stages")
        duration = parse_duration(options.duration)
        stages = [Stage(duration, level, level)]
    return RunConfig(
        mode=mode,
        stages=tuple(stages),
        arrival=Arrival(options.arrival),
        connections=options.connections,
        timeout_s=parse_duration(options.timeout),
        retry_429=options.retry_429,
        max_retries=options.max_retries,
        max_retry_after_s=parse_duration(options.max_retry_after),
        drain_timeout_s=parse_duration(options.drain_timeout),
        seed=options.seed,
    )


def report(
    result: RunResult,
    url: str,
    label: str,
    out_dir: Path | None,
    slo_p99_ms: float | None,
    max_error_rate: float | None,
    plots: bool,
    stream: TextIO,
) -> Outcome:
    """Summarise, judge, print the table and write the files; returns the exit status."""
    summary = summarize(result, url, label)
    summary.verdict = judge(summary, slo_p99_ms, max_error_rate)
    # The table first: a file that cannot be written must not lose the run's result.
    stream.write(format_table(summary) + "\n")
    exit_code = EXIT_PASS if summary.verdict.passed else EXIT_FAIL
    files: list[Path] = []
    if out_dir is not None:
        try:
            files.append(write_json(summary, result, out_dir / "report.json"))
            if plots:
                files.extend(write_plots(summary, result, out_dir, slo_p99_ms))
        except OSError as error:
            sys.stderr.write(f"error: cannot write the run's files to {out_dir}: {error}\n")
            if exit_code == EXIT_PASS:
                exit_code = EXIT_FILES  # not an SLA failure: CI must not read it as one
    if files:
        stream.write(f"files       {out_dir}/ ({', '.join(p.name for p in files)})\n")
    return Outcome(summary, result, files, exit_code)


def default_out_dir(label: str) -> Path:
    return DEFAULT_RESULTS_DIR / f"{time.strftime('%Y%m%d-%H%M%S')}-{label}"


def command_run(options: argparse.Namespace) -> int:
    lift_open_file_limit()  # ramps to thousands of connections meet EMFILE at 1024
    target = Target.parse(options.url)
    config = build_config(options)
    payloads = build_payloads(options, target)
    progress = None if options.quiet else ProgressPrinter(sys.stderr, config.duration_s)
    result = run_event_loop(
        lambda: execute(config, target, payloads, progress), use_uvloop=not options.no_uvloop
    )
    out_dir = None if options.no_files else Path(options.out or default_out_dir(options.label))
    outcome = report(
        result,
        options.url,
        options.label,
        out_dir,
        options.slo_p99_ms,
        options.max_error_rate,
        plots=not options.no_plots,
        stream=sys.stdout,
    )
    if outcome.exit_code != EXIT_PASS:
        assert outcome.summary.verdict is not None
        for reason in outcome.summary.verdict.reasons:
            sys.stderr.write(f"SLA violated: {reason}\n")
    return outcome.exit_code


def result_from_hey_csv(
    rows: Sequence[dict[str, str]], concurrency: int, expected: int | None
) -> RunResult:
    """A closed-loop `RunResult` from ``hey -o csv`` rows (one per response).

    hey leaves failed requests (no response) out of its CSV; with ``expected`` (its -n)
    the missing ones are counted as requests with no response.
    """
    recorder = Recorder()
    last = 0.0
    for row in rows:
        started = float(row["offset"])
        done = started + float(row["response-time"])
        last = max(last, done)
        recorder.record(started, started, done, int(row["status-code"]), "", 0)
    if expected is not None:
        for _ in range(max(expected - len(rows), 0)):
            recorder.record(last, last, last, 0, ERROR_KINDS[5], 0)
    duration = max(last, 1e-3)
    config = RunConfig(
        mode=Mode.CLOSED,
        stages=(Stage(duration, concurrency, concurrency),),
        monitor_interval_s=1.0,
    )
    return RunResult(
        config=config,
        recorder=recorder,
        started_at=0.0,
        finished_at=last,
        scheduled_total=len(recorder),
        dispatch_lags=recorder.scheduled[:0],
    )


def command_hey_summary(options: argparse.Namespace) -> int:
    with contextlib.ExitStack() as stack:
        stream: TextIO = sys.stdin if options.csv == "-" else stack.enter_context(open(options.csv))
        rows = list(csv.DictReader(stream))
    result = result_from_hey_csv(rows, options.concurrency, options.expected)
    out_dir = Path(options.out) if options.out else None
    outcome = report(
        result,
        options.url,
        "hey",
        out_dir,
        options.slo_p99_ms,
        options.max_error_rate,
        plots=not options.no_plots,
        stream=sys.stdout,
    )
    return outcome.exit_code


def _add_verdict_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--slo-p99-ms", type=float, help="Fail (exit 1) when the p99 of 2xx latencies exceeds this."
    )
    parser.add_argument(
        "--max-error-rate",
        type=float,
        help="Fail (exit 1) when more than this share of requests (0..1) is not answered 2xx.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser(
        "run",
        help="one load test",
        description="Open-loop (default) or closed-loop load test with table, JSON and plots.",
    )
    run.add_argument("--url", default="http://127.0.0.1:8000/infer", help="Where to POST.")
    run.add_argument("--mode", choices=["open", "closed"], default="open")
    run.add_argument("--rate", type=float, help="Open loop: arrivals per second.")
    run.add_argument("--concurrency", type=int, help="Closed loop: connections.")
    run.add_argument("--duration", default="20s", help="With --rate/--concurrency (e.g. 30s, 2m).")
    run.add_argument(
        "--stages",
        help="Ramps instead of one level: 'DURATION:TARGET' holds, 'DURATION:FROM-TO' ramps "
        "linearly, e.g. '30s:50-500,60s:500,30s:500-5000'. Targets are req/s (open) or "
        "connections (closed).",
    )
    run.add_argument("--arrival", choices=["constant", "poisson"], default="constant")
    run.add_argument(
        "--connections",
        type=int,
        default=512,
        help="Open loop: most connections in use at once; beyond, requests queue in the "
        "client with their wait counted in their latency.",
    )
    run.add_argument("--timeout", default="30s", help="Per-request timeout.")
    run.add_argument(
        "--retry-429",
        action="store_true",
        help="Retry 429s after their Retry-After (latency still counts from the first send).",
    )
    run.add_argument("--max-retries", type=int, default=3)
    run.add_argument("--max-retry-after", default="10s", help="Cap on a Retry-After honored.")
    run.add_argument(
        "--drain-timeout", default="30s", help="Grace after the last send for answers to arrive."
    )
    bodies = run.add_argument_group("request bodies")
    bodies.add_argument("--body-jsonl", help="One JSON request body per line, cycled through.")
    bodies.add_argument(
        "--words",
        default="fixed:12",
        help="Generated sentences' length in words: fixed:N, uniform:A-B, lognormal:MEDIAN:SIGMA.",
    )
    bodies.add_argument("--inputs-per-request", type=int, default=1)
    bodies.add_argument("--body-count", type=int, default=1000, help="Distinct generated bodies.")
    bodies.add_argument("--timeout-ms", type=float, help="Add timeout_ms to every body.")
    bodies.add_argument("--extra-json", help="JSON object merged into every body.")
    bodies.add_argument(
        "--header", action="append", default=[], help="Extra header 'Name: value' (repeatable)."
    )
    output = run.add_argument_group("output")
    output.add_argument("--label", default="run", help="Name in the table, titles and folder.")
    output.add_argument("--out", help="Folder for report.json and the plots.")
    output.add_argument("--no-plots", action="store_true")
    output.add_argument("--no-files", action="store_true", help="Print the table only.")
    output.add_argument("--quiet", action="store_true", help="No progress line.")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--no-uvloop", action="store_true", help="Use the standard asyncio loop.")
    _add_verdict_options(run)
    run.set_defaults(handler=command_run)

    hey = commands.add_parser("hey-summary", help="summarise `hey -o csv` output")
    hey.add_argument("csv", help="The CSV file, or - for standard input.")
    hey.add_argument("--url", default="-", help="Shown in the table.")
    hey.add_argument("--concurrency", type=int, default=1, help="hey's -c, for the table.")
    hey.add_argument("--expected", type=int, help="hey's -n: rows missing are failures.")
    hey.add_argument("--out", help="Folder for report.json and the plots.")
    hey.add_argument("--no-plots", action="store_true")
    _add_verdict_options(hey)
    hey.set_defaults(handler=command_hey_summary)

    bench = commands.add_parser(
        "compare",
        aliases=["bench"],
        help="raw vs naive vs steadyserve comparison (`make bench`; same as loadtest.bench)",
        add_help=False,
    )
    bench.set_defaults(handler=None)
    return parser


def _with_subcommand(arguments: list[str]) -> list[str]:
    """`run` is the sub-command when the first argument is an option."""
    if arguments and arguments[0].startswith("-") and arguments[0] not in ("-h", "--help"):
        return ["run", *arguments]
    return arguments


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """The command line `main` runs (the comparison's, after `bench` or `compare`); SystemExit
    (status 2) on a usage error."""
    if argv and argv[0] in ("bench", "compare"):
        from loadtest import bench

        return bench.build_parser().parse_args(argv[1:])
    return build_parser().parse_args(_with_subcommand(argv))


def main(argv: list[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    if arguments and arguments[0] in ("bench", "compare"):
        from loadtest import bench

        return bench.main(arguments[1:])
    if not arguments:
        build_parser().print_help(sys.stderr)
        return EXIT_USAGE
    options = parse_arguments(arguments)
    try:
        handler: Callable[[argparse.Namespace], int] = options.handler
        return handler(options)
    except (ValueError, OSError) as error:  # a bad option, or an input file it cannot read
        sys.stderr.write(f"error: {error}\n")
        return EXIT_USAGE
