"""Chunked prefill's measurement: how much one long prompt stalls the streams already running
(`generate_prefill_chunk_tokens`). Not part of `make bench`, not a test.

The engine process over ZeroMQ, as the generation bench drives it (`generation_bench.
served_settings`, `EngineSupervisor`, `ZmqEngineClient`, `generation_phases.make_prompts`),
serving the tiny random-weight causal LM with KV-cache slots of 512 tokens: `--streams`
sequences of short prompts decode `--new-tokens` tokens each, greedy, while long prompts
(`--long-tokens`, one new token each) arrive one after another (the next sent as the last
gets its token) until every stream has ended. Per chunk size, in alternating rounds:

- the streams' time per output token: p50 and p99 of the gaps between two consecutive
  tokens of one stream, over all streams (a gap is one step, or a step behind a prefill),
  and the largest such gap;
- the long prompts' time to first token, p50 and p99.

A chunk of `--long-tokens` or more (512) is chunking off: a long prompt prefills in one step.

    python -m loadtest.prefill_stall [--chunks 512,64,128] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transformers import AutoTokenizer

from app.engine.protocol import GeneratePayload, SamplingParams, Submit, TokensOutput
from app.engine.zmq_client import ZmqEngineClient
from loadtest.generation_bench import served_settings
from loadtest.generation_phases import MODEL_NAME, engine_process, make_prompts
from loadtest.stats import nearest_rank
from loadtest.tiny_causal_lm import build_tiny_causal_lm

SLOT_TOKENS = 512


@dataclass
class Round:
    chunk: int
    gaps_ms: list[float] = field(default_factory=list)  # streams' consecutive token gaps
    long_ttft_ms: list[float] = field(default_factory=list)
    long_prompts: int = 0
    stream_tokens: int = 0

    def summary(self) -> dict[str, float | int | None]:
        def q(values: list[float], quantile: float) -> float | None:
            found = nearest_rank(values, quantile)
            return None if found is None else round(found, 2)

        return {
            "chunk": self.chunk,
            "tpot_p50_ms": q(self.gaps_ms, 0.5),
            "tpot_p99_ms": q(self.gaps_ms, 0.99),
            "max_gap_ms": round(max(self.gaps_ms), 2) if self.gaps_ms else None,
            "long_ttft_p50_ms": q(self.long_ttft_ms, 0.5),
            "long_ttft_p99_ms": q(self.long_ttft_ms, 0.99),
            "long_prompts": self.long_prompts,
            "stream_tokens": self.stream_tokens,
        }


def _request(client: ZmqEngineClient, prompt: list[int], new: int) -> Submit:
    sampling = SamplingParams(max_new_tokens=new)
    payload = GeneratePayload(prompt, sampling)
    return Submit(client.next_request_id(), MODEL_NAME, time.monotonic() + 120, payload)


async def _stream(client: ZmqEngineClient, prompt: list[int], new: int) -> list[float]:
    """Each token's arrival time (an output of k tokens: k arrivals at once)."""
    arrivals: list[float] = []
    async for output in client.stream(_request(client, prompt, new)):
        assert isinstance(output.payload, TokensOutput)
        arrivals.extend([time.perf_counter()] * len(output.payload.token_ids))
    return arrivals


async def _long_prompts(
    client: ZmqEngineClient, prompts: list[list[int]], done: asyncio.Event, into: Round
) -> None:
    """One long prompt after another (each one token) until the streams are done."""
    index = 0
    while not done.is_set():
        sent = time.perf_counter()
        arrivals = await _stream(client, prompts[index % len(prompts)], 1)
        if arrivals:
            into.long_ttft_ms.append((arrivals[0] - sent) * 1000)
        into.long_prompts += 1
        index += 1


async def one_round(
    directory: Path,
    chunk: int,
    streams: list[list[int]],
    longs: list[list[int]],
    options: argparse.Namespace,
) -> Round:
    settings = served_settings(directory).model_copy(
        update={
            "generate_slot_tokens": SLOT_TOKENS,
            "generate_prefill_chunk_tokens": chunk,
            "generate_slots": max(32, len(streams) + 1),
        }
    )
    result = Round(chunk)
    async with engine_process(settings) as client:
        await _stream(client, longs[0], 2)  # warm: one long prompt, alone
        await asyncio.gather(*(_stream(client, p, 4) for p in streams))
        done = asyncio.Event()
        feeder = asyncio.create_task(_long_prompts(client, longs, done, result))
        await asyncio.sleep(0.05)  # the first long prompt is in flight
        answers = await asyncio.gather(*(_stream(client, p, options.new_tokens) for p in streams))
        done.set()
        await feeder
        for arrivals in answers:
            result.stream_tokens += len(arrivals)
            result.gaps_ms += [(b - a) * 1000 for a, b in itertools.pairwise(arrivals)]
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.prefill_stall")
    parser.add_argument("--chunks", default="512,64,128", help="chunk sizes, in this order")
    parser.add_argument("--rounds", type=int, default=2, help="each chunk size, alternated")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-tokens", type=int, default=450)
    parser.add_argument("--hidden", type=int, default=64, help="model width (tiny: 64)")
    parser.add_argument("--layers", type=int, default=2, help="model layers (tiny: 2)")
    options = parser.parse_args(argv)
    chunks = [int(c) for c in options.chunks.split(",")]
    rounds: list[Round] = []
    with tempfile.TemporaryDirectory(prefix="tiny-causal-lm-") as tmp:
        directory = build_tiny_causal_lm(
            Path(tmp) / "tiny", hidden_size=options.hidden, layers=options.layers
        )
        tokenizer = AutoTokenizer.from_pretrained(directory)
        streams = make_prompts(tokenizer, options.streams, 16)
        longs = [p for p in make_prompts(tokenizer, 4, options.long_tokens)]
        assert all(len(p) == options.long_tokens for p in longs), "corpus too short"
        for number in range(options.rounds):
            for chunk in chunks:
                found = asyncio.run(one_round(directory, chunk, streams, longs, options))
                rounds.append(found)
                line = json.dumps({"round": number + 1, **found.summary()})
                sys.stdout.write(line + "\n")
                sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
