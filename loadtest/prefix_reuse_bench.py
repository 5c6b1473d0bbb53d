"""Prefix reuse's measurement: what `generate_prefix_reuse` (app/engine/slot_table.py) buys
when prompts share a long prefix, and what it costs when they share none. A step of
`make bench` (after the generation bench), not a test.

The engine process over ZeroMQ, as the generation bench drives it (`served_settings`,
`engine_process`, `engine_wave`), serving the tiny random-weight causal LM (`--hidden`,
`--layers`) with `--requests` KV-cache slots of 512 tokens. For `--rounds` pairs, prefix
reuse on then off, each its own engine process with the setting in its Settings:

- shared: `--requests` prompts at once, each a `--prefix-tokens` prefix common to all (a
  system prompt or few-shot examples, corpus text) and a distinct `--tail-tokens` tail,
  `--new-tokens` new tokens each, greedy; one unmeasured wave first fills the slots'
  records, then `--waves` measured waves, every wave with new tails;
- control: the same, every prompt random tokens after BOS (the same total length): any
  prefix two share is by chance and far under the 16 tokens reuse needs.

Per workload and setting: tokens/s (the median wave), TTFT p50 / p99 (every wave's), the
prompt tokens prefilled per wave (prompt tokens less the engine's
`steadyserve_generate_prefix_reused_tokens_total`, read from its multiprocess metrics
files), and the on/off ratios of tokens/s and TTFT p50; a markdown table and one line.

    python -m loadtest.prefix_reuse_bench [--rounds 2] [--prefix-tokens 384] [--requests 32]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from app.engine.zmq_client import ZmqEngineClient
from app.metrics import MULTIPROCESS_DIR_ENV
from app.metrics_render import render_processes
from loadtest.generation_bench import ms_text, served_settings
from loadtest.generation_phases import Phase, engine_process, engine_wave, make_prompts, pooled
from loadtest.tiny_causal_lm import build_tiny_causal_lm

SLOT_TOKENS = 512
REUSED_COUNTER = "steadyserve_generate_prefix_reused_tokens_total"
WORKLOADS = ("shared", "control")
PREFILLED = "prefill tokens/wave"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.prefix_reuse_bench")
    parser.add_argument("--rounds", type=int, default=2, help="on/off pairs, alternated")
    parser.add_argument("--waves", type=int, default=2, help="measured waves per workload")
    parser.add_argument("--requests", type=int, default=32, help="prompts a wave (at once)")
    parser.add_argument("--prefix-tokens", type=int, default=384, help="shared, BOS included")
    parser.add_argument("--tail-tokens", type=int, default=16, help="distinct, per prompt")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (tiny: 2)")
    options = parser.parse_args(argv)
    total = options.prefix_tokens + options.tail_tokens + options.new_tokens
    if total > SLOT_TOKENS:
        parser.error(f"prefix + tail + new tokens is {total}, over a slot's {SLOT_TOKENS}")
    if min(options.rounds, options.waves, options.requests, options.tail_tokens) < 1:
        parser.error("--rounds, --waves, --requests and --tail-tokens must be at least 1")
    if options.prefix_tokens < 2:
        parser.error("--prefix-tokens must be at least 2 (BOS and one token)")
    return options


class Prompts:
    """Each wave's prompts, new tails every wave (a wave's prompts are never the previous
    wave's, so only the shared prefix is there to reuse), the same for both settings."""

    def __init__(self, tokenizer: Any, options: argparse.Namespace) -> None:
        (self.prefix,) = make_prompts(tokenizer, 1, options.prefix_tokens)
        if len(self.prefix) != options.prefix_tokens:
            raise SystemExit(f"the corpus is shorter than --prefix-tokens {options.prefix_tokens}")
        self.pool = self.prefix[1:]  # ordinary tokens to draw tails from
        self.options = options

    def wave(self, workload: str, number: int) -> list[list[int]]:
        draw = random.Random(f"{workload}-{number}")
        o = self.options
        if workload == "shared":
            head, length = self.prefix, o.tail_tokens
        else:  # BOS, then random tokens throughout
            head, length = self.prefix[:1], o.prefix_tokens + o.tail_tokens - 1
        return [head + draw.choices(self.pool, k=length) for _ in range(o.requests)]


@contextlib.contextmanager
def engine_metrics() -> Iterator[None]:
    """The engine process spawned inside writes its metrics to a directory of its own
    (prometheus_client's multiprocess mode, as under `steadyserve serve`)."""
    previous = os.environ.get(MULTIPROCESS_DIR_ENV)
    with tempfile.TemporaryDirectory(prefix="engine-metrics-") as directory:
        os.environ[MULTIPROCESS_DIR_ENV] = directory
        try:
            yield
        finally:
            if previous is None:
                del os.environ[MULTIPROCESS_DIR_ENV]
            else:
                os.environ[MULTIPROCESS_DIR_ENV] = previous


def reused_tokens() -> float | None:
    """The engine's reused prompt tokens so far; None where they cannot be read."""
    try:
        text = render_processes().decode()
    except (OSError, KeyError, ValueError):
        return None
    found = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == REUSED_COUNTER
    ]
    return sum(found) if found else 0.0


async def measured(
    client: ZmqEngineClient, prompts: Prompts, workload: str, options: argparse.Namespace
) -> list[Phase]:
    """One unmeasured wave (it fills the slots' records), then the measured ones."""
    new = options.new_tokens
    await engine_wave(client, prompts.wave(workload, 0), new, "fill")
    waves: list[Phase] = []
    for number in range(1, options.waves + 1):
        batch = prompts.wave(workload, number)
        before = reused_tokens()
        wave = await engine_wave(client, batch, new, workload)
        after = reused_tokens()
        if before is not None and after is not None:
            prefilled = sum(map(len, batch)) - (after - before)
            wave = replace(wave, extra={PREFILLED: prefilled})
        waves.append(wave)
    return waves


async def one_engine(
    directory: Path, reuse: bool, prompts: Prompts, options: argparse.Namespace
) -> dict[str, list[Phase]]:
    settings = served_settings(directory).model_copy(
        update={
            "generate_slot_tokens": SLOT_TOKENS,
            "generate_slots": options.requests,
            "generate_prefix_reuse": reuse,
        }
    )
    with engine_metrics():
        async with engine_process(settings) as client:
            return {w: await measured(client, prompts, w, options) for w in WORKLOADS}


# --- report --------------------------------------------------------------------------
def _ratio(on: float | None, off: float | None) -> float | None:
    return on / off if on and off else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _prefilled(waves: list[Phase]) -> float | None:
    values = [w.extra[PREFILLED] for w in waves if PREFILLED in w.extra]
    return sum(values) / len(values) if values and len(values) == len(waves) else None


def report(results: dict[tuple[str, bool], list[Phase]], prefix_tokens: int) -> str:
    """The markdown table (a row per workload and setting, then its on/off ratios) and the
    verdict line, from every measured wave of each (workload, reuse on?)."""
    rows = [
        "| workload | prefix reuse | waves | tokens/s | TTFT p50 / p99 ms | prefill tokens/wave |",
        "|---|---|---:|---:|---:|---:|",
    ]
    ratios: dict[str, tuple[float | None, float | None]] = {}
    for workload in WORKLOADS:
        summary: dict[bool, Phase] = {}
        for reuse in (True, False):
            waves = results.get((workload, reuse), [])
            if not waves:
                continue
            p = summary[reuse] = pooled(waves)
            prefilled = _prefilled(waves)
            rows.append(
                f"| {workload} | {'on' if reuse else 'off'} | {len(waves)} "
                f"| {p.tokens_per_s:.0f} | {ms_text(p.ttft_p50_ms)} / {ms_text(p.ttft_p99_ms)} "
                f"| {'-' if prefilled is None else f'{prefilled:.0f}'} |"
            )
        if True in summary and False in summary:
            on, off = summary[True], summary[False]
            speed = _ratio(on.tokens_per_s, off.tokens_per_s)
            ttft = _ratio(on.ttft_p50_ms, off.ttft_p50_ms)
            ratios[workload] = (speed, ttft)
            rows.append(f"| {workload} | on/off | | {_x(speed)} | {_x(ttft)} (p50) | |")
    names = {
        "shared": f"shared {prefix_tokens}-token prefix",
        "control": "control (no shared prefix)",
    }
    parts = [
        f"{names[w]}: tokens/s {_x(speed)}, TTFT p50 {_x(ttft)}"
        for w, (speed, ttft) in ratios.items()
    ]
    verdict = "prefix reuse on/off: " + ("; ".join(parts) if parts else "no pair measured")
    return "\n".join(rows) + "\n\n" + verdict


def main(argv: list[str] | None = None) -> int:
    options = parse_args(argv)
    results: dict[tuple[str, bool], list[Phase]] = {}
    with tempfile.TemporaryDirectory(prefix="tiny-causal-lm-") as tmp:
        directory = build_tiny_causal_lm(
            Path(tmp) / "tiny", hidden_size=options.hidden, layers=options.layers
        )
        prompts = Prompts(AutoTokenizer.from_pretrained(directory), options)
        for number in range(options.rounds):
            for reuse in (True, False):
                found = asyncio.run(one_engine(directory, reuse, prompts, options))
                for workload, waves in found.items():
                    results.setdefault((workload, reuse), []).extend(waves)
                speeds = ", ".join(
                    f"{w} {p.tokens_per_s:.0f}" for w, ws in found.items() for p in ws
                )
                setting = "on" if reuse else "off"
                sys.stderr.write(
                    f"[prefix-reuse-bench] round {number + 1}, reuse {setting}: {speeds} tokens/s\n"
                )
    print(report(results, options.prefix_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
