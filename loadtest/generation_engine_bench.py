"""The generation engine alone, with the tiny random-weight causal LM
(tests/support/tiny_causal_lm.py): 32 concurrent requests, 16-token prompts, 32 new tokens
each (greedy), measured back to back. The companion of `loadtest/generation_bench.py` (the
whole server over HTTP): this one leaves the HTTP front end out, and adds transformers'
ContinuousBatchingManager in-process, the measurement behind choosing our own slot engine
(docs/BENCHMARKS.md).

- steadyserve: the real engine process (ZeroMQ, as served; no HTTP front end), every
  request streamed at once;
- `model.generate` one prompt at a time, and one left-padded batch of all prompts, in-process;
- transformers' ContinuousBatchingManager in-process (`generate_batch`, explicit cache sizes);
- `transformers serve --continuous-batching` (explicit cache sizes), the same prompts as
  text over HTTP, all at once;
- overload: 8x the requests at once at steadyserve: the admitted keep their time per output
  token, the rest are refused 429 (`queue`).

Same dtype (`auto`: bf16 on a CPU with native bf16, fp16 on CUDA) and CPU threads for all.

    python -m loadtest.generation_engine_bench [--requests 32] [--no-serve]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from app.admission import Rejected
from app.engine.process import EngineAddresses
from app.engine.protocol import GeneratePayload, SamplingParams, Submit, TokensOutput
from app.engine.supervisor import EngineSupervisor
from app.engine.zmq_client import ZmqEngineClient
from app.models.base import resolve_device, resolve_dtype
from app.settings import ModelSpec, Settings
from app.telemetry.cgroup import available_cpus
from tests.support.tiny_causal_lm import CORPUS, build_tiny_causal_lm

SLOT_TOKENS = 64


@dataclass(frozen=True)
class PhaseResult:
    phase: str
    requests: int
    tokens: int
    seconds: float
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    refused: int = 0
    note: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_prompts(tokenizer: AutoTokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of exactly `length` tokens (BOS included)."""
    text = " ".join(CORPUS * 4)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id]
    return [bos + ids[i * 7 : i * 7 + length - 1] for i in range(count)]


def produced(new_tokens: list[int], eos: set[int]) -> int:
    """Tokens a sequence generated: those before its EOS (padding follows it in a batch)."""
    for index, token in enumerate(new_tokens):
        if token in eos:
            return index
    return len(new_tokens)


def eos_ids(model: PreTrainedModel) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {int(eos)}


def one_at_a_time(model: PreTrainedModel, prompts: list[list[int]], new: int) -> PhaseResult:
    eos = eos_ids(model)
    tokens = 0
    started = time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=model.device)
            output = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False
            )
            tokens += produced(output[0, len(prompt) :].tolist(), eos)
    return PhaseResult("generate, one prompt at a time", len(prompts), tokens, _since(started))


def padded_batch(
    model: PreTrainedModel, tokenizer: AutoTokenizer, prompts: list[list[int]], new: int
) -> PhaseResult:
    eos = eos_ids(model)
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**batch, max_new_tokens=new, do_sample=False)
    seconds = _since(started)
    width = batch["input_ids"].shape[1]
    tokens = sum(produced(row[width:].tolist(), eos) for row in output)
    return PhaseResult("generate, one padded batch", len(prompts), tokens, seconds)


def cb_manager(model: PreTrainedModel, prompts: list[list[int]], new: int) -> PhaseResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    eos = eos_ids(model)
    config = GenerationConfig(
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=model.generation_config.eos_token_id,
        pad_token_id=model.generation_config.pad_token_id,
    )
    cache = ContinuousBatchingConfig(page_size=32, num_blocks=128, max_batch_tokens=1024)
    model.generate_batch(prompts[:2], config, cache, max_new_tokens=4)  # its own warm-up
    started = time.perf_counter()
    results = model.generate_batch(prompts, config, cache, max_new_tokens=new)
    seconds = _since(started)
    tokens = sum(produced(list(r.generated_tokens), eos) for r in results.values())
    return PhaseResult(
        "transformers ContinuousBatchingManager, in-process",
        len(prompts),
        tokens,
        seconds,
        note="page 32 x 128 blocks, 1024 batch tokens",
    )


def _since(started: float) -> float:
    return time.perf_counter() - started


# --- steadyserve -------------------------------------------------------------------------
@dataclass
class _Timing:
    submitted: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


async def _one(client: ZmqEngineClient, prompt: list[int], new: int) -> _Timing | Rejected:
    request = Submit(
        client.next_request_id(),
        "tiny",
        time.monotonic() + 60,
        GeneratePayload(prompt, SamplingParams(max_new_tokens=new)),
    )
    timing = _Timing(time.perf_counter())
    try:
        async for output in client.stream(request):
            now = time.perf_counter()
            assert isinstance(output.payload, TokensOutput)
            if output.payload.token_ids and timing.first is None:
                timing.first = now
            timing.tokens += len(output.payload.token_ids)
            timing.last = now
    except Rejected as refused:
        return refused
    return timing


async def _wave(
    client: ZmqEngineClient, prompts: list[list[int]], new: int, name: str
) -> PhaseResult:
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(_one(client, prompt, new) for prompt in prompts))
    timings = [o for o in outcomes if isinstance(o, _Timing)]
    refused = len(outcomes) - len(timings)
    end = max(t.last or started for t in timings)
    ttft = [((t.first or t.submitted) - t.submitted) * 1000 for t in timings]
    tpot = [
        ((t.last or 0) - (t.first or 0)) / (t.tokens - 1) * 1000 for t in timings if t.tokens > 1
    ]
    return PhaseResult(
        name,
        len(timings),
        sum(t.tokens for t in timings),
        end - started,
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p99_ms=percentile(ttft, 0.99),
        tpot_p50_ms=percentile(tpot, 0.5) if tpot else None,
        refused=refused,
    )


def median_round(rounds: list[PhaseResult]) -> PhaseResult:
    """The round with the median tokens/s (single rounds of ~0.1 s are noisy)."""
    return sorted(rounds, key=lambda r: r.tokens_per_s)[len(rounds) // 2]


async def steadyserve(
    directory: Path,
    prompts: list[list[int]],
    new: int,
    overload: int,
    rounds: int,
    thread_plan: tuple[int | None, int | None],
) -> list[PhaseResult]:
    settings = Settings(
        models=(ModelSpec(name="tiny", task="generate", source=str(directory)),),
        generate_slots=len(prompts),
        generate_slot_tokens=SLOT_TOKENS,
        generate_max_batch_tokens=1024,
        length_buckets=(16, 32),
        spike_reports=False,
        # Unset: the served default (on 2 CPUs, 2 compute threads x 1 torch thread).
        dispatcher_threads=thread_plan[0],
        torch_threads=thread_plan[1],
    )
    with tempfile.TemporaryDirectory(prefix="genbench-") as run_dir:
        addresses = EngineAddresses.in_directory(Path(run_dir))
        client = ZmqEngineClient(addresses)
        supervisor = EngineSupervisor(settings, addresses)
        await client.start()
        supervisor.start()
        try:
            await client.wait_ready(120)
            await _wave(client, prompts[:2], 4, "warm")
            results = [
                await _wave(
                    client, prompts, new, f"steadyserve engine process, {len(prompts)} at once"
                )
            ]
            many = [prompts[i % len(prompts)] for i in range(overload * len(prompts))]
            results.append(
                await _wave(
                    client, many, new, f"steadyserve, {overload}x overload ({len(many)} at once)"
                )
            )
            return results
        finally:
            await supervisor.stop()
            await client.close()


# --- transformers serve ------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _serve(directory: Path, dtype: torch.dtype, threads: int) -> Iterator[str]:
    port = _free_port()
    command = [
        str(Path(sys.executable).with_name("transformers")),
        "serve",
        str(directory),
        "--continuous-batching",
        "--cb-block-size", "32",
        "--cb-num-blocks", "128",
        "--cb-max-batch-tokens", "1024",
        "--device", "cpu",
        "--dtype", str(dtype).removeprefix("torch."),
        "--host", "127.0.0.1",
        "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        give_up_at = time.monotonic() + 90
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"transformers serve exited: {process.stderr.read()[-2000:]!r}")  # type: ignore[union-attr]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > give_up_at:
                raise RuntimeError("transformers serve did not become healthy in 90 s")
            time.sleep(0.2)  # polling interval while it loads
        yield base
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


async def _serve_wave(base: str, model: str, texts: list[str], new: int) -> tuple[int, float]:
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:

        async def one(text: str) -> int:
            body = {"model": model, "prompt": text, "max_tokens": new, "temperature": 0}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return int(response.json()["usage"]["completion_tokens"])

        started = time.perf_counter()
        tokens = await asyncio.gather(*(one(text) for text in texts))
        return sum(tokens), _since(started)


def transformers_serve(
    directory: Path,
    tokenizer: AutoTokenizer,
    prompts: list[list[int]],
    new: int,
    dtype: torch.dtype,
    threads: int,
) -> PhaseResult:
    texts = [tokenizer.decode(p, skip_special_tokens=True) for p in prompts]
    with _serve(directory, dtype, threads) as base:
        asyncio.run(_serve_wave(base, str(directory), texts[:2], 4))
        tokens, seconds = asyncio.run(_serve_wave(base, str(directory), texts, new))
    return PhaseResult(
        "transformers serve --continuous-batching (HTTP)",
        len(prompts),
        tokens,
        seconds,
        note="block 32 x 128 blocks, 1024 batch tokens; prompts re-tokenized from text",
    )


# --- report ------------------------------------------------------------------------------
def table(results: list[PhaseResult]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f}"

    rows = [
        "| phase | requests | tokens | s | tokens/s | TTFT p50 ms | TTFT p99 ms "
        "| TPOT p50 ms | refused |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.phase} | {r.requests} | {r.tokens} | {r.seconds:.2f} | {r.tokens_per_s:.0f} "
            f"| {ms(r.ttft_p50_ms)} | {ms(r.ttft_p99_ms)} | {ms(r.tpot_p50_ms)} | {r.refused} |"
        )
    return "\n".join(rows)


def verdicts(results: dict[str, PhaseResult]) -> list[str]:
    ours = results["steadyserve"]
    lines: list[str] = []

    def ratio(name: str, other: str, target: float) -> None:
        if other in results:
            value = ours.tokens_per_s / results[other].tokens_per_s
            met = "met" if value >= target else "NOT met"
            lines.append(f"steadyserve / {name}: {value:.2f}x (target >= {target}: {met})")

    ratio("padded batch in-process", "padded", 0.8)
    ratio("transformers serve --continuous-batching", "serve", 1.2)
    ratio("one prompt at a time", "single", 1.0)
    ratio("ContinuousBatchingManager in-process", "cb", 1.0)
    if ours.ttft_p50_ms and ours.ttft_p99_ms:
        spread = ours.ttft_p99_ms / ours.ttft_p50_ms
        lines.append(
            f"TTFT p99/p50: {spread:.2f} (target <= 2: {'met' if spread <= 2 else 'NOT met'})"
        )
    overload = results.get("overload")
    if overload and overload.tpot_p50_ms and ours.tpot_p50_ms:
        lines.append(
            f"overload: {overload.requests} admitted, {overload.refused} refused (429); admitted "
            f"TPOT p50 {overload.tpot_p50_ms:.1f} ms vs {ours.tpot_p50_ms:.1f} ms unloaded "
            f"({overload.tpot_p50_ms / ours.tpot_p50_ms:.2f}x)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--overload", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=64, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (tiny: 2)")
    parser.add_argument("--dispatcher-threads", type=int, help="engine compute threads")
    parser.add_argument("--torch-threads", type=int, help="torch threads per compute thread")
    parser.add_argument("--rounds", type=int, default=5, help="median of these (fast phases)")
    parser.add_argument("--no-serve", action="store_true", help="skip transformers serve")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)

    threads = available_cpus()
    torch.set_num_threads(threads)
    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    results: dict[str, PhaseResult] = {}
    with tempfile.TemporaryDirectory(prefix="tiny-causal-lm-") as tmp:
        directory = build_tiny_causal_lm(
            Path(tmp) / "tiny", hidden_size=args.hidden, layers=args.layers
        )
        tokenizer = AutoTokenizer.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype).to(device).eval()
        prompts = make_prompts(tokenizer, args.requests, args.prompt_tokens)
        new = args.new_tokens
        print(f"{len(prompts)} prompts x {args.prompt_tokens} tokens, {new} new; hidden "
              f"{args.hidden} x {args.layers} layers, {dtype}, {threads} CPU threads",
              flush=True)  # fmt: skip

        rounds = args.rounds
        plan = (args.dispatcher_threads, args.torch_threads)
        ours, overload = asyncio.run(
            steadyserve(directory, prompts, new, args.overload, rounds, plan)
        )
        results["steadyserve"], results["overload"] = ours, overload
        one_at_a_time(model, prompts[:2], 4)  # warm-up
        results["single"] = one_at_a_time(model, prompts, new)
        padded_batch(model, tokenizer, prompts[:2], 4)
        results["padded"] = median_round(
            [padded_batch(model, tokenizer, prompts, new) for _ in range(rounds)]
        )
        try:
            results["cb"] = cb_manager(model, prompts, new)
        except Exception as error:  # a library path, reported rather than fatal
            print(f"ContinuousBatchingManager failed: {type(error).__name__}: {error}")
        if not args.no_serve:
            try:
                results["serve"] = transformers_serve(
                    directory, tokenizer, prompts, new, dtype, threads
                )
            except Exception as error:
                print(f"transformers serve failed: {type(error).__name__}: {error}")
    print(table(list(results.values())))
    for line in verdicts(results):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({k: asdict(v) for k, v in results.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
