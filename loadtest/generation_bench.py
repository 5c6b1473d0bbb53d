"""Generation throughput and latency with the tiny random-weight causal LM (issue 8's bench).

Back to back in one run, the same prompts (~16 tokens each) and `--new-tokens` new tokens
per request, greedy:

1. `generate` in-process, one prompt at a time;
2. one padded batch `generate` in-process (all prompts, left padding);
3. steadyserve (`steadyserve serve`, the model as a `generate` task) with `--requests`
   concurrent `POST /v1/completions`;
4. `transformers serve --continuous-batching` with explicit cache sizes, the same requests;
5. steadyserve at `--overload`x the concurrency: time per output token of the admitted
   requests against its value at 1x, and how many were refused with 429.

Tokens/s counts the tokens each request actually produced (a sequence may end early at
EOS). Time to first token is measured with `stream: true` (first chunk that carries text);
time per output token is (last chunk - first chunk) / (chunks - 1) of a streamed request.

    python -m loadtest.generation_bench [--requests 32] [--new-tokens 32] [--out DIR]

(part of ``make bench``). Targets (issue 8): steadyserve >= 0.8x the padded batch and
>= 1.2x `transformers serve`; TTFT p99 <= 2x its p50; at 8x, admitted requests keep their
time per output token, the rest get 429.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.bench import REPO_ROOT, ForeignLoad, _free_port
from loadtest.overload_bench import Server, start_server

MODEL_NAME = "tiny"
PROMPT_TOKENS = 16


def _log(message: str) -> None:
    sys.stderr.write(f"[generation-bench] {message}\n")
    sys.stderr.flush()


def _percentile(values: Sequence[float], share: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


@dataclass(frozen=True)
class Throughput:
    requests: int
    new_tokens: int
    seconds: float
    refused: int = 0
    foreign_cores: float | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class Streamed:
    """Per admitted streamed request: time to first token and time per output token."""

    ttft_s: list[float]
    tpot_s: list[float]
    refused: int
    other_errors: int


def make_prompts(model_dir: Path, count: int) -> list[str]:
    """`count` prompts of about PROMPT_TOKENS tokens, cut from varied sentences."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    words = [
        *("latency", "batch", "queue", "token", "cache", "model", "request", "server"),
        *("tail", "budget", "decode", "prefill", "engine", "front", "slot", "block"),
        *("admit", "refuse", "stream", "chunk"),
    ]
    prompts = []
    for index in range(count):
        text = " ".join(words[(index * 7 + k * 3) % len(words)] for k in range(24))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:PROMPT_TOKENS]
        prompts.append(tokenizer.decode(ids))
    return prompts


def _new_tokens(rows: Any, prompt_width: int, eos: int) -> int:
    """Tokens generated per row, up to and including its EOS (padding after it not counted)."""
    total = 0
    for row in rows.tolist():
        produced = row[prompt_width:]
        total += produced.index(eos) + 1 if eos in produced else len(produced)
    return total


def measure_in_process(model_dir: Path, prompts: list[str], new_tokens: int) -> dict[str, Any]:
    """One prompt at a time, then one padded batch: tokens/s of each."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    eos = int(tokenizer.eos_token_id)
    pad = int(tokenizer.pad_token_id)
    options = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": pad}
    with torch.inference_mode():
        model.generate(**tokenizer(prompts[:2], return_tensors="pt", padding=True), **options)
        started = time.perf_counter()
        produced = 0
        for prompt in prompts:
            encoded = tokenizer(prompt, return_tensors="pt")
            out = model.generate(**encoded, **options)
            produced += _new_tokens(out, encoded["input_ids"].shape[1], eos)
        one_at_a_time = Throughput(len(prompts), produced, time.perf_counter() - started)
        encoded = tokenizer(prompts, return_tensors="pt", padding=True)
        started = time.perf_counter()
        out = model.generate(**encoded, **options)
        padded = Throughput(
            len(prompts),
            _new_tokens(out, encoded["input_ids"].shape[1], eos),
            time.perf_counter() - started,
        )
    return {"one_at_a_time": one_at_a_time, "padded_batch": padded}


async def _complete(client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int) -> Any:
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
    response = await client.post(url, json=body)
    return response.status_code, response.json() if response.status_code == 200 else None


async def _throughput(url: str, model: str, prompts: list[str], new_tokens: int) -> Throughput:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        await _complete(client, url, model, prompts[0], 2)  # connection and first-use warm-up
        started = time.perf_counter()
        results = await asyncio.gather(
            *(_complete(client, url, model, prompt, new_tokens) for prompt in prompts)
        )
        seconds = time.perf_counter() - started
    tokens = sum(body["usage"]["completion_tokens"] for status, body in results if status == 200)
    refused = sum(1 for status, _ in results if status == 429)
    return Throughput(len(prompts), tokens, seconds, refused)


async def _stream_one(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, n: int
) -> tuple[int, list[float]]:
    """(status, arrival time of each chunk that carries text)."""
    body = {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "stream": True}
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return response.status_code, []
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if any(choice.get("text") for choice in chunk.get("choices", [])):
                arrivals.append(time.perf_counter() - sent)
    return 200, arrivals


async def _streamed(url: str, model: str, prompts: list[str], new_tokens: int) -> Streamed:
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(limits=limits, timeout=300) as client:
        results = await asyncio.gather(
            *(_stream_one(client, url, model, prompt, new_tokens) for prompt in prompts)
        )
    ttft = [arrivals[0] for status, arrivals in results if status == 200 and arrivals]
    tpot = [
        (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1)
        for status, arrivals in results
        if status == 200 and len(arrivals) > 1
    ]
    refused = sum(1 for status, _ in results if status == 429)
    others = sum(1 for status, _ in results if status not in (200, 429))
    return Streamed(ttft, tpot, refused, others)


def _wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)  # polling a server that is starting
    raise TimeoutError(f"{url} not answering within {timeout_s:g} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def measure_steadyserve(
    model_dir: Path, prompts: list[str], new_tokens: int, overload: int, out: Path
) -> dict[str, Any]:
    models = [{"name": MODEL_NAME, "task": "generate", "source": str(model_dir)}]
    server: Server = start_server(
        _free_port(), {"STEADY_MODELS": json.dumps(models)}, out / "generation-steadyserve.log"
    )
    try:
        server.wait_ready(300)
        url = f"{server.base_url}/v1/completions"
        load = ForeignLoad([os.getpid(), server.process.pid])
        throughput = asyncio.run(_throughput(url, MODEL_NAME, prompts, new_tokens))
        throughput = Throughput(**{**asdict(throughput), "foreign_cores": load.cores()})
        streamed = asyncio.run(_streamed(url, MODEL_NAME, prompts, new_tokens))
        crowd = [prompts[i % len(prompts)] for i in range(len(prompts) * overload)]
        overloaded = asyncio.run(_streamed(url, MODEL_NAME, crowd, new_tokens))
    finally:
        _stop(server.process)
    return {"throughput": throughput, "streamed": streamed, "overloaded": overloaded}


def measure_transformers_serve(
    model_dir: Path, prompts: list[str], new_tokens: int, out: Path, cache: argparse.Namespace
) -> dict[str, Any]:
    port = _free_port()
    command = [
        str(Path(sys.executable).with_name("transformers")), "serve", str(model_dir),
        "--continuous-batching", "--device", "cpu", "--port", str(port),
        "--cb-num-blocks", str(cache.cb_num_blocks), "--cb-block-size", str(cache.cb_block_size),
        "--cb-max-batch-tokens", str(cache.cb_max_batch_tokens),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with (out / "generation-transformers-serve.log").open("wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        _wait_http(f"{base}/health", process, 120)
        url = f"{base}/v1/completions"
        load = ForeignLoad([os.getpid(), process.pid])
        throughput = asyncio.run(_throughput(url, str(model_dir), prompts, new_tokens))
        throughput = Throughput(**{**asdict(throughput), "foreign_cores": load.cores()})
        streamed = asyncio.run(_streamed(url, str(model_dir), prompts, new_tokens))
    finally:
        _stop(process)
    return {"throughput": throughput, "streamed": streamed}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def report(results: dict[str, Any], overload: int) -> str:
    padded: Throughput = results["in_process"]["padded_batch"]
    rows = [
        "| run | tokens/s | vs padded batch | TTFT p50 / p99 ms | TPOT p50 ms | refused |",
        "|---|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, throughput: Throughput, streamed: Streamed | None) -> str:
        ttft, tpot = "-", "-"
        if streamed is not None:
            p50, p99 = _percentile(streamed.ttft_s, 0.5), _percentile(streamed.ttft_s, 0.99)
            ttft = f"{_ms(p50)} / {_ms(p99)}"
            tpot = _ms(_percentile(streamed.tpot_s, 0.5))
        ratio = throughput.tokens_per_s / padded.tokens_per_s if padded.tokens_per_s else 0.0
        return (
            f"| {name} | {throughput.tokens_per_s:.0f} | {ratio:.2f} | {ttft} | {tpot} "
            f"| {throughput.refused} |"
        )

    rows.append(row("generate, one prompt at a time", results["in_process"]["one_at_a_time"], None))
    rows.append(row("generate, one padded batch", padded, None))
    ours = results["steadyserve"]
    rows.append(row("steadyserve", ours["throughput"], ours["streamed"]))
    theirs = results.get("transformers_serve")
    if theirs is not None:
        name = "transformers serve --continuous-batching"
        rows.append(row(name, theirs["throughput"], theirs["streamed"]))
    lines = rows
    overloaded: Streamed = ours["overloaded"]
    base_tpot = _percentile(ours["streamed"].tpot_s, 0.5)
    over_tpot = _percentile(overloaded.tpot_s, 0.5)
    lines.append("")
    lines.append(
        f"At {overload}x ({len(overloaded.ttft_s) + overloaded.refused + overloaded.other_errors}"
        f" streamed requests at once): {len(overloaded.ttft_s)} admitted with TPOT p50 "
        f"{_ms(over_tpot)} ms (1x: {_ms(base_tpot)} ms), {overloaded.refused} refused with "
        f"429, {overloaded.other_errors} other errors."
    )
    if theirs is not None and theirs["throughput"].tokens_per_s:
        ratio = ours["throughput"].tokens_per_s / theirs["throughput"].tokens_per_s
        lines.append(f"steadyserve / transformers serve tokens/s: {ratio:.2f} (target >= 1.2).")
    ttft = ours["streamed"].ttft_s
    p50, p99 = _percentile(ttft, 0.5), _percentile(ttft, 0.99)
    if p50 and p99:
        lines.append(f"steadyserve TTFT p99/p50: {p99 / p50:.2f} (target <= 2).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.generation_bench")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--overload", type=int, default=8)
    parser.add_argument("--cb-num-blocks", type=int, default=64)
    parser.add_argument("--cb-block-size", type=int, default=32)
    parser.add_argument("--cb-max-batch-tokens", type=int, default=512)
    parser.add_argument("--skip-transformers-serve", action="store_true")
    parser.add_argument("--out", default=str(REPO_ROOT / "loadtest" / "results"))
    options = parser.parse_args(argv)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    sys.path.insert(0, str(REPO_ROOT))
    from tests.support.tiny_causal_lm import build_tiny_causal_lm

    with tempfile.TemporaryDirectory(prefix="steadyserve-tiny-lm-") as directory:
        model_dir = build_tiny_causal_lm(Path(directory))
        prompts = make_prompts(model_dir, options.requests)
        results: dict[str, Any] = {}
        _log("in-process generate")
        results["in_process"] = measure_in_process(model_dir, prompts, options.new_tokens)
        _log("steadyserve")
        results["steadyserve"] = measure_steadyserve(
            model_dir, prompts, options.new_tokens, options.overload, out
        )
        if not options.skip_transformers_serve:
            _log("transformers serve --continuous-batching")
            results["transformers_serve"] = measure_transformers_serve(
                model_dir, prompts, options.new_tokens, out, options
            )
    table = report(results, options.overload)
    print(table)
    (out / "generation-bench.json").write_text(
        json.dumps(results, default=lambda o: {**asdict(o)}, indent=2)
    )
    (out / "generation-bench.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
