"""The phases of the generation bench (`loadtest/generation_bench.py`), each measured the
same way whatever serves it: in-process `generate` baselines and transformers'
ContinuousBatchingManager, waves of requests to the steadyserve engine process over ZeroMQ
(no HTTP), and waves of OpenAI completions over HTTP (steadyserve or `transformers serve`).

A wave sends every request at once and times it from the first send to the last answer;
tokens count what each sequence actually produced (it may end early at EOS). Time to first
token is from a request's send to its first chunk that carries text; time per output token
is (last text arrival - first) / (tokens - 1). Bench process only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import orjson
import torch
from transformers import PreTrainedModel

from app.admission import Rejected
from app.engine.process import EngineAddresses
from app.engine.protocol import GeneratePayload, SamplingParams, Submit, TokensOutput
from app.engine.supervisor import EngineSupervisor
from app.engine.zmq_client import ZmqEngineClient
from app.settings import Settings
from loadtest.httpclient import ConnectionPool
from loadtest.localserver import free_port
from loadtest.proctree import stop_process
from loadtest.stats import nearest_rank
from loadtest.tiny_causal_lm import CORPUS

MODEL_NAME = "tiny"


@dataclass(frozen=True)
class Phase:
    """One measured wave (or the median of several): what it produced and how fast."""

    name: str
    requests: int  # answered (not refused)
    tokens: int
    seconds: float
    ttft_ms: tuple[float, ...] = ()
    tpot_ms: tuple[float, ...] = ()
    refused: int = 0  # 429
    errors: int = 0  # any other failure
    note: str = ""
    extra: dict[str, float] = field(default_factory=dict)
    wave_ttft_spreads: tuple[float, ...] = ()  # pooled: each wave's own TTFT p99/p50
    wave_ttft_counts: tuple[int, ...] = ()  # pooled: each wave's TTFT sample count

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def ttft_p50_ms(self) -> float | None:
        return nearest_rank(self.ttft_ms, 0.5)

    @property
    def ttft_p99_ms(self) -> float | None:
        return nearest_rank(self.ttft_ms, 0.99)

    @property
    def tpot_p50_ms(self) -> float | None:
        return nearest_rank(self.tpot_ms, 0.5)


def median_round(rounds: list[Phase]) -> Phase:
    """The round with the median tokens/s (single waves of ~0.1-0.2 s are noisy)."""
    return sorted(rounds, key=lambda r: r.tokens_per_s)[len(rounds) // 2]


def pooled(rounds: list[Phase]) -> Phase:
    """The median round's throughput with every round's latencies (more samples for p99)."""
    middle = median_round(rounds)
    ttft = tuple(v for r in rounds for v in r.ttft_ms)
    tpot = tuple(v for r in rounds for v in r.tpot_ms)
    spreads: list[float] = []
    counts: list[int] = []
    for r in rounds:
        p50, p99 = r.ttft_p50_ms, r.ttft_p99_ms
        if p50 and p99:
            spreads.append(p99 / p50)
            counts.append(len(r.ttft_ms))
    return replace(
        middle,
        ttft_ms=ttft,
        tpot_ms=tpot,
        wave_ttft_spreads=tuple(spreads),
        wave_ttft_counts=tuple(counts),
    )


def make_prompts(tokenizer: Any, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of exactly `length` tokens (BOS included)."""
    text = " ".join(CORPUS * 4)
    ids: list[int] = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos = [tokenizer.bos_token_id]
    return [bos + ids[i * 7 : i * 7 + length - 1] for i in range(count)]


def _since(started: float) -> float:
    return time.perf_counter() - started


# --- in-process baselines ------------------------------------------------------------
def produced(new_tokens: list[int], eos: set[int]) -> int:
    """Tokens a sequence generated before its EOS (padding follows it in a batch), as
    steadyserve counts them."""
    for index, token in enumerate(new_tokens):
        if token in eos:
            return index
    return len(new_tokens)


def eos_ids(model: PreTrainedModel) -> set[int]:
    eos = model.generation_config.eos_token_id
    return set(eos) if isinstance(eos, list) else {int(eos)}


def one_at_a_time(model: PreTrainedModel, prompts: list[list[int]], new: int) -> Phase:
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
    return Phase("generate, one prompt at a time", len(prompts), tokens, _since(started))


def padded_batch(
    model: PreTrainedModel, tokenizer: Any, prompts: list[list[int]], new: int
) -> Phase:
    eos = eos_ids(model)
    tokenizer.padding_side = "left"
    batch = tokenizer.pad({"input_ids": prompts}, return_tensors="pt").to(model.device)
    started = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**batch, max_new_tokens=new, do_sample=False)
    seconds = _since(started)
    width = batch["input_ids"].shape[1]
    tokens = sum(produced(row[width:].tolist(), eos) for row in output)
    return Phase("generate, one left-padded batch", len(prompts), tokens, seconds)


def cb_manager(model: PreTrainedModel, prompts: list[list[int]], new: int) -> Phase:
    """transformers' ContinuousBatchingManager in-process (`generate_batch`)."""
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
    return Phase(
        "transformers ContinuousBatchingManager, in-process",
        len(prompts),
        tokens,
        seconds,
        note="page 32 x 128 blocks, 1024 batch tokens",
    )


# --- the steadyserve engine process over ZeroMQ --------------------------------------
@dataclass
class Timing:
    submitted: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0


async def _engine_one(client: ZmqEngineClient, prompt: list[int], new: int) -> Timing | None:
    request = Submit(
        client.next_request_id(),
        MODEL_NAME,
        time.monotonic() + 60,
        GeneratePayload(prompt, SamplingParams(max_new_tokens=new)),
    )
    timing = Timing(time.perf_counter())
    try:
        async for output in client.stream(request):
            now = time.perf_counter()
            assert isinstance(output.payload, TokensOutput)
            if output.payload.token_ids and timing.first is None:
                timing.first = now
            timing.tokens += len(output.payload.token_ids)
            timing.last = now
    except Rejected:
        return None
    return timing


def wave_latencies(timings: list[Timing]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(TTFT ms, TPOT ms) of a wave's answered sequences. A sequence that produced no token
    has no first token: it is left out of TTFT (as over HTTP), not counted as 0 ms."""
    ttft = tuple((t.first - t.submitted) * 1000 for t in timings if t.first is not None)
    tpot = tuple(
        (t.last - t.first) / (t.tokens - 1) * 1000
        for t in timings
        if t.tokens > 1 and t.first is not None and t.last is not None
    )
    return ttft, tpot


async def engine_wave(
    client: ZmqEngineClient, prompts: list[list[int]], new: int, name: str
) -> Phase:
    """Every prompt submitted at once to the engine process, streamed back."""
    started = time.perf_counter()
    outcomes = await asyncio.gather(*(_engine_one(client, prompt, new) for prompt in prompts))
    timings = [o for o in outcomes if o is not None]
    end = max((t.last or started for t in timings), default=started)
    ttft, tpot = wave_latencies(timings)
    refused = len(outcomes) - len(timings)
    tokens = sum(t.tokens for t in timings)
    return Phase(name, len(timings), tokens, end - started, ttft, tpot, refused)


# --- OpenAI completions over HTTP ----------------------------------------------------
# On loadtest/httpclient.py's keep-alive connections, pooled as the openai client pools
# them and as Envoy pools its upstream ones (in deployment no request opens a connection to
# a front end): the client shares the machine's cores with the server it measures, and with
# hundreds of streams at once httpx's own cost delayed reading so much that an overloaded
# wave's chunks were read in one go.
HTTP_TIMEOUT_S = 300.0


def _payload(pool: ConnectionPool, body: dict[str, Any]) -> bytes:
    return pool.target.post_bytes(orjson.dumps(body))


async def _whole(pool: ConnectionPool, body: dict[str, Any]) -> tuple[int, int]:
    """(status, completion tokens) of one non-streamed completion."""
    response = await pool.request(_payload(pool, body), HTTP_TIMEOUT_S)
    if response.status != 200:
        return response.status, 0
    return 200, int(orjson.loads(response.body)["usage"]["completion_tokens"])


async def _streamed(
    pool: ConnectionPool, body: dict[str, Any]
) -> tuple[int, list[float], int | None]:
    """(status, arrival times of the chunks that carry text, completion tokens from the
    usage chunk when the server sends one)."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    usage: list[int] = []
    buffer = b""

    def on_data(data: bytes) -> None:
        nonlocal buffer
        now = time.perf_counter() - sent
        *frames, buffer = (buffer + data).split(b"\n\n")
        for frame in frames:
            if not frame.startswith(b"data: {"):
                continue
            chunk = orjson.loads(frame[6:])
            if chunk.get("usage"):
                usage.append(int(chunk["usage"]["completion_tokens"]))
            for choice in chunk.get("choices") or ():
                if choice.get("text") or (choice.get("delta") or {}).get("content"):
                    arrivals.append(now)

    response = await pool.request(_payload(pool, body), HTTP_TIMEOUT_S, on_data)
    if response.status != 200:
        return response.status, [], None
    return 200, arrivals, usage[-1] if usage else None


async def http_wave(
    pool: ConnectionPool, model: str, prompts: list[str], new: int, name: str
) -> Phase:
    """Every prompt at once as a non-streamed completion: tokens/s."""
    body = {"model": model, "max_tokens": new, "temperature": 0}
    started = time.perf_counter()
    results = await asyncio.gather(*(_whole(pool, {**body, "prompt": p}) for p in prompts))
    seconds = _since(started)
    ok = [tokens for status, tokens in results if status == 200]
    refused = sum(1 for status, _ in results if status == 429)
    errors = len(results) - len(ok) - refused
    return Phase(name, len(ok), sum(ok), seconds, refused=refused, errors=errors)


async def http_stream_wave(
    pool: ConnectionPool, model: str, prompts: list[str], new: int, name: str
) -> Phase:
    """Every prompt at once as a streamed completion: TTFT and TPOT of each answered one."""
    body = {"model": model, "max_tokens": new, "temperature": 0, "stream": True}
    body["stream_options"] = {"include_usage": True}
    started = time.perf_counter()
    results = await asyncio.gather(*(_streamed(pool, {**body, "prompt": p}) for p in prompts))
    seconds = _since(started)
    answered = [(arrivals, tokens) for status, arrivals, tokens in results if status == 200]
    ttft = tuple(arrivals[0] * 1000 for arrivals, _ in answered if arrivals)
    tpot = []
    total = 0
    for arrivals, tokens in answered:
        count = tokens if tokens is not None else len(arrivals)
        total += count
        if len(arrivals) > 1 and count > 1:
            tpot.append((arrivals[-1] - arrivals[0]) / (count - 1) * 1000)
    refused = sum(1 for status, _, _ in results if status == 429)
    errors = len(results) - len(answered) - refused
    return Phase(name, len(answered), total, seconds, ttft, tuple(tpot), refused, errors)


def wait_http(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    give_up_at = time.monotonic() + timeout_s
    while time.monotonic() < give_up_at:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)  # polling a server that is starting
    raise TimeoutError(f"{url} not answering within {timeout_s:g} s")


@contextlib.contextmanager
def transformers_serve(
    directory: Path, device: torch.device, dtype: torch.dtype, threads: int, log: Path
) -> Iterator[str]:
    """`transformers serve --continuous-batching` with explicit cache sizes, on the device
    and in the dtype steadyserve serves the model with (a GPU where there is one), so the two
    are compared like for like; yields its base URL."""
    port = free_port()
    command = [
        str(Path(sys.executable).with_name("transformers")), "serve", str(directory),
        "--continuous-batching",
        "--cb-block-size", "32", "--cb-num-blocks", "128", "--cb-max-batch-tokens", "1024",
        "--device", str(device), "--dtype", str(dtype).removeprefix("torch."),
        "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    with log.open("wb") as output:
        process = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/health", process, 120)
        yield base
    finally:
        stop_process(process)


@contextlib.asynccontextmanager
async def supervised_engine(
    settings: Settings,
) -> AsyncIterator[tuple[ZmqEngineClient, EngineSupervisor]]:
    """The engine process as `steadyserve serve` supervises it (`settings`), ready, a
    ZeroMQ client connected to it (no HTTP front end), and its supervisor (restarts);
    stopped on exit."""
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as run_dir:
        addresses = EngineAddresses.in_directory(Path(run_dir))
        client = ZmqEngineClient(addresses)
        supervisor = EngineSupervisor(settings, addresses)
        await client.start()
        supervisor.start()
        try:
            await client.wait_ready(120)
            yield client, supervisor
        finally:
            await supervisor.stop()
            await client.close()


@contextlib.asynccontextmanager
async def engine_process(settings: Settings) -> AsyncIterator[ZmqEngineClient]:
    """`supervised_engine`'s client alone."""
    async with supervised_engine(settings) as (client, _):
        yield client
