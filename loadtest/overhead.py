"""The cost of slow-request reports: steadyserve with the recorder and its probes on
(`STEADY_SPIKE_REPORTS=true`, the default) against off, back to back, same load.

Runs the two in an ABBA order (off, on, on, off) so a drift in the machine's other load
over the run weighs on both alike, and reports each run's req/s and p99, the mean of each
setting, and on/off throughput (the target: at least 0.98). On a shared machine the
runs' spread says how far to trust the ratio: it is printed with it, as are the cores
other processes used during each run; a run during which they used more than
`--max-other-cores` is run again (up to `--retries` times), and the last attempt counts.

``python -m loadtest.overhead [--duration 15s] [--connections 64] [--out DIR]``
(part of ``make bench``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from loadtest.bench import build_parser
from loadtest.bench_phases import PhaseOutcome, bench_sentences, log, measure_steadyserve
from loadtest.httpclient import Target
from loadtest.localserver import REPO_ROOT
from loadtest.stages import parse_duration

ORDER = ("off", "on", "on", "off")
# `--order on,off,off,on` swaps the roles (a bump in the machine's load mid-run shows up).
TARGET_RATIO = 0.98


def _rate(outcome: PhaseOutcome) -> float:
    return outcome.throughput_rps


def _p99_ms(outcome: PhaseOutcome) -> float:
    return outcome.p99_ms or 0.0


def verdict(rates: dict[str, list[float]]) -> tuple[float, float]:
    """(on/off ratio of mean throughputs, the largest relative spread between two runs of
    one setting)."""
    means = {setting: statistics.fmean(values) for setting, values in rates.items()}
    spread = max((max(v) - min(v)) / statistics.fmean(v) for v in rates.values())
    return means["on"] / means["off"], spread


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    parser.prog = "python -m loadtest.overhead"
    parser.set_defaults(duration="15s")
    parser.add_argument("--order", default=",".join(ORDER), help="Runs, comma-separated.")
    parser.add_argument(
        "--max-other-cores",
        type=float,
        default=0.1,
        help="A run during which other processes used more CPU than this is run again.",
    )
    parser.add_argument("--retries", type=int, default=3, help="At most this many reruns.")
    options = parser.parse_args(argv)
    order = [setting.strip() for setting in options.order.split(",")]
    if set(order) != {"on", "off"}:
        parser.error("--order needs both on and off")
    options.duration_s = parse_duration(options.duration)
    options.warmup_s = parse_duration(options.warmup)
    options.ready_timeout_s = parse_duration(options.ready_timeout)
    out_dir = Path(
        options.out or REPO_ROOT / "loadtest/results" / time.strftime("overhead-%Y%m%d-%H%M%S")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    sentences = bench_sentences(1000, options.words, options.seed)

    def payloads_for(target: Target) -> list[bytes]:
        return [
            target.post_bytes(json.dumps({"inputs": text}, separators=(",", ":")).encode())
            for text in sentences
        ]

    rates: dict[str, list[float]] = {"on": [], "off": []}
    # CPU the server's processes spent per request: what the recorder costs, much less
    # disturbed than throughput by other work on a shared machine.
    cpu_per_request: dict[str, list[float]] = {"on": [], "off": []}
    runs = []
    for index, setting in enumerate(order):
        env = {"STEADY_SPIKE_REPORTS": "true" if setting == "on" else "false"}
        for attempt in range(1 + options.retries):
            log(f"run {index + 1}/{len(order)}: spike reports {setting} (attempt {attempt + 1})")
            outcome = measure_steadyserve(
                options,
                payloads_for,
                out_dir,
                name=f"{index + 1}-{setting}-{attempt + 1}",
                extra_env=env,
            )
            foreign = outcome.details.get("foreign_cores")
            # A run during which other processes took CPU measures them, not the reports:
            # it is run again (a shared machine's builds and tests come and go).
            if foreign is None or float(foreign) <= options.max_other_cores:
                break
            log(f"other processes took {float(foreign):.2f} cores: run {index + 1} again")
        rates[setting].append(_rate(outcome))
        server_cores = float(outcome.details.get("server_cores") or 0.0)
        cpu_ms = server_cores / _rate(outcome) * 1000 if _rate(outcome) else 0.0
        cpu_per_request[setting].append(cpu_ms)
        runs.append(
            {
                "setting": setting,
                "rps": round(_rate(outcome), 1),
                "p99_ms": round(_p99_ms(outcome), 1),
                "server_cpu_ms_per_request": round(cpu_ms, 3),
                "foreign_cores": None if foreign is None else round(float(foreign), 2),
            }
        )
    ratio, spread = verdict(rates)
    cpu_ratio, cpu_spread = verdict(cpu_per_request)
    lines = [
        "| run | spike reports | req/s | p99 ms | server CPU ms per request | other processes "
        "(cores) |",
        "|---|---|---:|---:|---:|---:|",
        *(
            f"| {i + 1} | {r['setting']} | {r['rps']} | {r['p99_ms']} | "
            f"{r['server_cpu_ms_per_request']} | {r['foreign_cores']} |"
            for i, r in enumerate(runs)
        ),
        "",
        f"server CPU per request, on/off: {cpu_ratio:.3f} (largest spread between two runs "
        f"of one setting: {cpu_spread:.1%})",
        f"on/off throughput: {ratio:.3f} (target >= {TARGET_RATIO}); largest spread between "
        f"two runs of one setting: {spread:.1%}"
        + (" -- the machine's noise is larger than the effect measured" if spread > 0.02 else ""),
    ]
    table = "\n".join(lines)
    print("\n" + table, flush=True)
    arguments = sys.argv[1:] if argv is None else argv
    document = {
        "command": " ".join(["python -m loadtest.overhead", *arguments]),
        "runs": runs,
        "ratio_on_off": ratio,
        "spread": spread,
        "cpu_per_request_on_off": cpu_ratio,
        "cpu_spread": cpu_spread,
    }
    (out_dir / "overhead.json").write_text(json.dumps(document, indent=2) + "\n")
    (out_dir / "overhead.md").write_text(table + "\n")
    print(f"results in {out_dir}/", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
