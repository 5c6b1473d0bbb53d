"""Issue 8's generation bench: steadyserve's engine alone and the whole server over HTTP,
against the same baselines, back to back in one run, with the tiny random-weight causal LM
(loadtest/tiny_causal_lm.py; `--hidden`/`--layers` for a larger one).

`--requests` prompts of exactly `--prompt-tokens` tokens, `--new-tokens` new tokens each,
greedy, on steadyserve's device and dtype for all (`auto`: a GPU where there is one, else
bf16 on a CPU with native bf16), the in-process baselines on the engine's torch threads:

- steadyserve engine process over ZeroMQ (no HTTP front end): every request at once, and
  at `--overload`x;
- steadyserve over HTTP (`steadyserve serve`, default settings, the model its only generate
  model): non-streamed `POST /v1/completions` all at once (tokens/s), streamed (TTFT, TPOT),
  and streamed at `--overload`x; with the front end's and the engine's CPU per token;
- the shared baselines: `model.generate` one prompt at a time and one left-padded batch,
  in-process; transformers' ContinuousBatchingManager in-process; `transformers serve
  --continuous-batching` (explicit cache sizes) over HTTP, the same client as steadyserve's
  (`transformers[serving]`, the bench extra: `make setup-bench`).

Fast phases are the median of `--rounds` waves. For each of engine-only and HTTP it reports
the issue's ratios: >= 0.8x the padded batch, TTFT p99 <= 2x p50, and at 8x the admitted
keep their time per output token (the rest get 429); and the ratio to transformers serve,
judged (>= 1.2x) over HTTP only, the like-for-like comparison the target describes.

    python -m loadtest.generation_bench [--requests 32] [--rounds 5] [--no-serve] [--out DIR]

(part of ``make bench``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.dispatcher import configure_torch_threads, engine_thread_plan
from app.model_specs import ModelSpec
from app.models.base import resolve_device, resolve_dtype
from app.settings import Settings
from app.telemetry.cgroup import available_cpus
from loadtest.generation_phases import (
    MODEL_NAME,
    Phase,
    cb_manager,
    engine_process,
    engine_wave,
    http_stream_wave,
    http_wave,
    make_prompts,
    median_round,
    one_at_a_time,
    padded_batch,
    pooled,
    transformers_serve,
)
from loadtest.httpclient import ConnectionPool, Target
from loadtest.localserver import REPO_ROOT, free_port
from loadtest.overload_server import start_server
from loadtest.proctree import cpu_seconds, stop_process
from loadtest.stats import nearest_rank, p99_sample_note
from loadtest.tiny_causal_lm import build_tiny_causal_lm


def _log(message: str) -> None:
    sys.stderr.write(f"[generation-bench] {message}\n")
    sys.stderr.flush()


def served_settings(directory: Path) -> Settings:
    """What the engine process serves with: default settings (with any STEADY_ variables in
    the environment, as `steadyserve serve` reads them), the model its only generate model."""
    return Settings(
        models=(ModelSpec(name=MODEL_NAME, task="generate", source=str(directory)),),
        spike_reports=False,
    )


async def engine_only(
    directory: Path, prompts: list[list[int]], options: argparse.Namespace
) -> dict[str, Phase]:
    """The engine process as served (default settings), driven over ZeroMQ."""
    settings = served_settings(directory)
    new, rounds = options.new_tokens, options.rounds
    async with engine_process(settings) as client:
        await engine_wave(client, prompts[:2], 4, "warm-up")
        name = f"steadyserve engine process (ZeroMQ), {len(prompts)} at once"
        waves = [await engine_wave(client, prompts, new, name) for _ in range(rounds)]
        many = [prompts[i % len(prompts)] for i in range(options.overload * len(prompts))]
        name = f"engine process, {options.overload}x overload ({len(many)} at once)"
        overload = await engine_wave(client, many, new, name)
        return {"steadyserve": pooled(waves), "overload": overload}


def over_http(directory: Path, texts: list[str], options: argparse.Namespace) -> dict[str, Phase]:
    """`steadyserve serve` with default settings, the model its only generate model."""
    models = [{"name": MODEL_NAME, "task": "generate", "source": str(directory)}]
    env = {"STEADY_MODELS": json.dumps(models)}
    server = start_server(free_port(), env, options.out / "generation-steadyserve.log")
    try:
        server.wait_ready(300)
        engine, front_ends = server.engine_pid(), server.frontend_pids()
        processes = {"front end": front_ends, "engine": [engine] if engine else []}
        url = f"{server.base_url}/v1/completions"
        return asyncio.run(_steadyserve_waves(url, texts, options, processes))
    finally:
        stop_process(server.process, timeout_s=60)


async def _steadyserve_waves(
    url: str, texts: list[str], options: argparse.Namespace, processes: dict[str, list[int]]
) -> dict[str, Phase]:
    """The waves of `over_http`, on one pool of keep-alive connections, with the CPU each
    process role spent per token in the measured waves."""
    new, rounds = options.new_tokens, options.rounds
    pool = ConnectionPool(Target.parse(url))
    try:
        await http_stream_wave(pool, MODEL_NAME, texts[:2], 4, "warm-up")
        await pool.fill(len(texts))
        before = {role: sum(map(cpu_seconds, pids)) for role, pids in processes.items()}
        name = f"steadyserve over HTTP, {len(texts)} at once"
        whole = [await http_wave(pool, MODEL_NAME, texts, new, name) for _ in range(rounds)]
        streamed = [
            await http_stream_wave(pool, MODEL_NAME, texts, new, name) for _ in range(rounds)
        ]
        tokens = sum(p.tokens for p in whole + streamed)
        cpu_us = {
            f"{role} CPU us/token": (sum(map(cpu_seconds, pids)) - before[role]) / tokens * 1e6
            for role, pids in processes.items()
        }
        crowd = [texts[i % len(texts)] for i in range(options.overload * len(texts))]
        name = f"HTTP, {options.overload}x overload ({len(crowd)} at once, streamed)"
        overload = await http_stream_wave(pool, MODEL_NAME, crowd, new, name)
    finally:
        pool.close()
    return {"steadyserve": _joined(whole, streamed, cpu_us), "overload": overload}


def _joined(whole: list[Phase], streamed: list[Phase], extra: dict[str, float]) -> Phase:
    """Tokens/s from the non-streamed waves, latencies from the streamed ones."""
    latencies = pooled(streamed)
    return replace(
        median_round(whole),
        ttft_ms=latencies.ttft_ms,
        tpot_ms=latencies.tpot_ms,
        wave_ttft_spreads=latencies.wave_ttft_spreads,
        wave_ttft_counts=latencies.wave_ttft_counts,
        extra=extra,
    )


def served_by_transformers(
    directory: Path,
    texts: list[str],
    options: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> Phase:
    model = str(directory)
    new, rounds = options.new_tokens, options.rounds
    log = options.out / "generation-transformers-serve.log"
    with transformers_serve(directory, device, dtype, available_cpus(), log) as base:
        pool = ConnectionPool(Target.parse(f"{base}/v1/completions"))
        name = "transformers serve --continuous-batching (HTTP)"

        async def waves() -> tuple[list[Phase], list[Phase]]:
            try:
                await http_wave(pool, model, texts[:2], 4, "warm-up")
                await pool.fill(len(texts))
                whole = [await http_wave(pool, model, texts, new, name) for _ in range(rounds)]
                streamed = [await http_stream_wave(pool, model, texts, new, name) for _ in range(3)]
            finally:
                pool.close()
            return whole, streamed

        whole, streamed = asyncio.run(waves())
    return _joined(whole, streamed, {})


# --- report --------------------------------------------------------------------------
def ms_text(value: float | None) -> str:
    """Milliseconds for a report table: one decimal, "-" for none."""
    return "-" if value is None else f"{value:.1f}"


def table(phases: list[Phase]) -> str:
    rows = [
        "| phase | answered | refused | tokens | s | tokens/s | TTFT p50 / p99 ms | TPOT p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        rows.append(
            f"| {p.name} | {p.requests} | {p.refused + p.errors} | {p.tokens} | {p.seconds:.3f} "
            f"| {p.tokens_per_s:.0f} | {ms_text(p.ttft_p50_ms)} / {ms_text(p.ttft_p99_ms)}"
            f"{p99_sample_note(len(p.ttft_ms))} "
            f"| {ms_text(p.tpot_p50_ms)} |"
        )
    return "\n".join(rows)


def verdicts(
    label: str, ours: Phase, overload: Phase, baselines: dict[str, Phase], over_http: bool
) -> list[str]:
    """The issue's ratios for one way of serving (`label`). The target against `transformers
    serve` (an HTTP server) is for steadyserve over HTTP: the engine alone skips the HTTP
    work that `transformers serve` pays, so its ratio is printed without a verdict."""
    lines: list[str] = []

    def ratio(name: str, key: str, target: float | None) -> None:
        other = baselines.get(key)
        if other is not None and other.tokens_per_s:
            value = ours.tokens_per_s / other.tokens_per_s
            if target is None:
                lines.append(f"{label} / {name}: {value:.2f}x")
                return
            met = "met" if value >= target else "NOT met"
            lines.append(f"{label} / {name}: {value:.2f}x (target >= {target:g}: {met})")

    ratio("padded batch in-process", "padded", 0.8)
    ratio("transformers serve --continuous-batching", "serve", 1.2 if over_http else None)
    ratio("one prompt at a time", "single", 1.0)
    ratio("ContinuousBatchingManager in-process", "cb", 1.0)
    if ours.ttft_p50_ms and ours.ttft_p99_ms:
        spread = ours.ttft_p99_ms / ours.ttft_p50_ms
        met = "met" if spread <= 2 else "NOT met"
        each = nearest_rank(ours.wave_ttft_spreads, 0.5)
        smallest = min(ours.wave_ttft_counts, default=0)
        per_wave = f" (n >= {smallest} per wave)" if p99_sample_note(smallest) else ""
        within = f"; median of the waves' own: {each:.2f}{per_wave}" if each is not None else ""
        lines.append(
            f"{label} TTFT p99/p50 over all waves{p99_sample_note(len(ours.ttft_ms))}: "
            f"{spread:.2f} (target <= 2: {met}){within}"
        )
    if overload.tpot_p50_ms and ours.tpot_p50_ms:
        lines.append(
            f"{overload.name}: {overload.requests} admitted, {overload.refused} refused "
            f"(429), {overload.errors} other errors; admitted TPOT p50 "
            f"{overload.tpot_p50_ms:.1f} ms vs {ours.tpot_p50_ms:.1f} ms at 1x "
            f"({overload.tpot_p50_ms / ours.tpot_p50_ms:.2f}x)"
        )
    for name, value in ours.extra.items():
        lines.append(f"{label} {name}: {value:.0f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.generation_bench")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--overload", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="median of these (fast phases)")
    parser.add_argument("--hidden", type=int, default=64, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (tiny: 2)")
    parser.add_argument("--no-serve", action="store_true", help="skip transformers serve")
    parser.add_argument("--no-http", action="store_true", help="skip steadyserve over HTTP")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "loadtest" / "results")
    options = parser.parse_args(argv)
    options.out.mkdir(parents=True, exist_ok=True)

    baselines: dict[str, Phase] = {}
    with tempfile.TemporaryDirectory(prefix="tiny-causal-lm-") as tmp:
        directory = build_tiny_causal_lm(
            Path(tmp) / "tiny", hidden_size=options.hidden, layers=options.layers
        )
        settings = served_settings(directory)
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.models[0].dtype, device, directory)
        # The in-process baselines run one batch at a time, as each of the engine's compute
        # threads does: they get the torch threads one compute thread gets (the engine's
        # plan for these settings on these CPUs, the rest going to front ends; 1 on 2 CPUs),
        # so a ratio compares batching and scheduling on equal compute, not the engine's
        # share of the machine against all of it.
        engine_plan = engine_thread_plan(settings, available_cpus())
        tokenizer = AutoTokenizer.from_pretrained(directory)
        prompts = make_prompts(tokenizer, options.requests, options.prompt_tokens)
        texts = [str(tokenizer.decode(p, skip_special_tokens=True)) for p in prompts]
        new = options.new_tokens
        _log(
            f"{len(prompts)} prompts x {options.prompt_tokens} tokens, {new} new; hidden "
            f"{options.hidden} x {options.layers} layers, {device}, {dtype}; engine "
            f"{engine_plan.compute_threads} compute thread(s), each torch intra-op "
            f"{engine_plan.torch_intra_op} as the in-process baselines; transformers serve "
            f"OMP {available_cpus()}"
        )
        _log("steadyserve engine process")
        engine = asyncio.run(engine_only(directory, prompts, options))
        http = None
        if not options.no_http:
            _log("steadyserve over HTTP")
            http = over_http(directory, texts, options)
        configure_torch_threads(engine_plan)
        _log(f"in-process baselines (torch intra-op {torch.get_num_threads()})")
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
        one_at_a_time(model, prompts[:2], 4)  # warm-up
        baselines["single"] = one_at_a_time(model, prompts, new)
        padded_batch(model, tokenizer, prompts[:2], 4)
        rounds = [padded_batch(model, tokenizer, prompts, new) for _ in range(options.rounds)]
        baselines["padded"] = median_round(rounds)
        try:
            baselines["cb"] = cb_manager(model, prompts, new)
        except Exception as error:  # a library path, reported rather than fatal
            _log(f"ContinuousBatchingManager failed: {type(error).__name__}: {error}")
        del model
        if not options.no_serve:
            _log("transformers serve --continuous-batching")
            try:
                baselines["serve"] = served_by_transformers(
                    directory, texts, options, device, dtype
                )
            except Exception as error:
                _log(f"transformers serve failed: {type(error).__name__}: {error}")
    phases = [engine["steadyserve"], engine["overload"]]
    lines = verdicts(
        "engine process", engine["steadyserve"], engine["overload"], baselines, over_http=False
    )
    if http is not None:
        phases += [http["steadyserve"], http["overload"]]
        lines += verdicts("HTTP", http["steadyserve"], http["overload"], baselines, over_http=True)
    report = table(phases + list(baselines.values())) + "\n\n" + "\n".join(lines)
    print(report)
    results = {"engine": engine, "http": http or {}, "baselines": baselines}
    serialised = {
        group: {
            key: {**asdict(p), "tokens_per_s": p.tokens_per_s} for key, p in group_phases.items()
        }
        for group, group_phases in results.items()
    }
    (options.out / "generation-bench.json").write_text(json.dumps(serialised, indent=2))
    (options.out / "generation-bench.md").write_text(report + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
