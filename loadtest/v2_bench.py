"""The v2 bench behind ``make bench``: a small exported torch module served as a `tensor`
model through the Open Inference Protocol, against the same module called in-process.

Three phases, back to back in one invocation, on the same CPUs (``--threads``):

1. **raw**: the exported program (`torch.export`, loaded as the server loads it) in this
   process with ``--threads`` torch threads; a short sweep finds the batch size with the
   most rows per second and that batch size runs for ``--duration``: the ceiling.
2. **v2 binary**: ``steadyserve serve`` with the module as its only model, driven in
   closed loop by ``--connections`` connections, one row per request, each request's
   tensor sent with the binary tensor data extension (outputs asked for as binary too).
3. **v2 JSON**: the same with the tensor as JSON numbers (outputs as JSON).

The module is an MLP (``--features`` -> ``--hidden`` -> ``--hidden`` -> ``--features``,
GELU) sized so that a row costs about what one ~12-word sentence costs all-MiniLM-L6-v2:
the target is the embeddings bench's, v2 binary >= 0.8x raw. Prints and writes (under
--out) the throughputs, latencies and the ratios binary/raw and JSON/binary.

``python -m loadtest.v2_bench [--duration 20s] [--connections 64] [--threads N]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from app.dispatcher import default_thread_plan
from app.telemetry.cgroup import available_cpus
from loadtest.bench import comparison_table
from loadtest.bench_phases import PhaseOutcome, log, measure_server
from loadtest.httpclient import Target
from loadtest.localserver import REPO_ROOT, free_port
from loadtest.minilm import configure_torch
from loadtest.stages import parse_duration

MODEL = "bench_mlp"


def export_mlp(path: Path, features: int, hidden: int) -> None:
    """Export the bench's MLP (fixed seed) with a dynamic batch dimension."""
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(features, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, hidden),
        torch.nn.GELU(),
        torch.nn.Linear(hidden, features),
    ).eval()
    batch = torch.export.Dim("batch", min=1, max=4096)
    program = torch.export.export(module, (torch.randn(2, features),), dynamic_shapes=({0: batch},))
    torch.export.save(program, path)


def measure_raw(options: argparse.Namespace, path: Path) -> PhaseOutcome:
    import torch

    configure_torch(options.threads)
    module = torch.export.load(str(path)).module()
    rng = np.random.default_rng(0)

    def rows_per_s(batch: int, seconds: float) -> float:
        inputs = torch.from_numpy(rng.standard_normal((batch, options.features), np.float32))
        done, started = 0, time.monotonic()
        with torch.inference_mode():
            while (elapsed := time.monotonic() - started) < seconds or done < 3 * batch:
                module(inputs)
                done += batch
        return done / elapsed

    rows_per_s(8, 1.0)  # one-off kernel set-up
    sweep = {batch: rows_per_s(batch, options.sweep_s) for batch in options.batch_sizes}
    for batch, rate in sweep.items():
        log(f"raw sweep: batch {batch:4d} -> {rate:9.1f} rows/s")
    best = max(sweep, key=lambda batch: sweep[batch])
    throughput = rows_per_s(best, options.duration_s)
    log(f"raw: {throughput:.1f} rows/s at batch {best}")
    return PhaseOutcome(
        "raw",
        f"raw in-process, batch {best}",
        throughput,
        None,
        None,
        None,
        0.0,
        {"best_batch_size": best, "sweep_rows_per_s": {str(k): round(v) for k, v in sweep.items()}},
    )


def binary_request(target: Target, row: np.ndarray) -> bytes:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "x",
                    "datatype": "FP32",
                    "shape": [1, row.size],
                    "parameters": {"binary_data_size": row.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        },
        separators=(",", ":"),
    ).encode()
    return target.post_bytes(
        header + row.tobytes(), {"Inference-Header-Content-Length": str(len(header))}
    )


def json_request(target: Target, row: np.ndarray) -> bytes:
    body = {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, row.size], "data": row.tolist()}]
    }
    return target.post_bytes(json.dumps(body, separators=(",", ":")).encode())


def measure_v2(
    options: argparse.Namespace, path: Path, name: str, encode: Any, out_dir: Path
) -> PhaseOutcome:
    port = free_port()
    target = Target.parse(f"http://127.0.0.1:{port}/v2/models/{MODEL}/infer")
    plan = default_thread_plan(options.threads)
    spec = {
        "name": MODEL,
        "task": "tensor",
        "source": str(path),
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, options.features]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, options.features]}],
    }
    env = {
        **os.environ,
        "STEADY_DISPATCHER_THREADS": str(plan.compute_threads),
        "STEADY_TORCH_THREADS": str(plan.torch_intra_op),
        "STEADY_MODELS": json.dumps([spec]),
        "STEADY_LOG_LEVEL": "warning",
    }
    for assignment in options.steady_env:
        key, _, value = assignment.partition("=")
        env[key] = value
    command = [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port", str(port)]
    rng = np.random.default_rng(1)
    rows = rng.standard_normal((256, options.features)).astype(np.float32)
    payloads = [encode(target, row) for row in rows]
    layout = f" {env['STEADY_DISPATCHER_THREADS']}x{env['STEADY_TORCH_THREADS']} threads"
    return measure_server(name, command, env, port, options, payloads, target, out_dir, layout)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", default="20s", help="each phase's measured run")
    parser.add_argument("--warmup", default="3s", help="closed-loop warm-up before each server run")
    parser.add_argument("--sweep", default="2s", help="each raw batch size's trial")
    parser.add_argument("--ready-timeout", default="120s")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--threads", type=int, default=available_cpus())
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=6144)
    parser.add_argument("--batch-sizes", default="1,4,8,16,32,64")
    parser.add_argument("--steady-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--out", default=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    options = build_parser().parse_args(argv)
    options.duration_s = parse_duration(options.duration)
    options.warmup_s = parse_duration(options.warmup)
    options.sweep_s = parse_duration(options.sweep)
    options.ready_timeout_s = parse_duration(options.ready_timeout)
    options.batch_sizes = [int(size) for size in options.batch_sizes.split(",")]
    out_dir = Path(
        options.out or REPO_ROOT / "loadtest/results" / time.strftime("v2-bench-%Y%m%d-%H%M%S")
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="v2-bench-") as directory:
        path = Path(directory) / "mlp.pt2"
        export_mlp(path, options.features, options.hidden)
        outcomes = {"raw": measure_raw(options, path)}
        outcomes["v2 binary"] = measure_v2(options, path, "v2_binary", binary_request, out_dir)
        outcomes["v2 JSON"] = measure_v2(options, path, "v2_json", json_request, out_dir)
    table = comparison_table(outcomes)[0].split("\n\n")[0]  # the rows; ratios below
    raw, binary, as_json = (o.throughput_rps for o in outcomes.values())
    ratios = {"v2_binary_vs_raw": binary / raw, "v2_json_vs_binary": as_json / binary}
    errors = {name: o.error_rate for name, o in outcomes.items()}
    print("\n" + table, flush=True)
    verdict = "met" if ratios["v2_binary_vs_raw"] >= 0.8 else "NOT met"
    print(
        f"v2 binary / raw: {ratios['v2_binary_vs_raw']:.2f}x (target >= 0.8x: {verdict}); "
        f"JSON / binary: {ratios['v2_json_vs_binary']:.2f}x",
        flush=True,
    )
    arguments = sys.argv[1:] if argv is None else argv
    document = {
        "command": " ".join(["python -m loadtest.v2_bench", *arguments]),
        "settings": {
            "duration_s": options.duration_s,
            "connections": options.connections,
            "threads": options.threads,
            "features": options.features,
            "hidden": options.hidden,
            "cpus": os.cpu_count(),
        },
        "phases": {name: outcome.__dict__ for name, outcome in outcomes.items()},
        "ratios": ratios,
        "error_rates": errors,
    }
    (out_dir / "v2_bench.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"results in {out_dir}/", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
