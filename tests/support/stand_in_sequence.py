"""A generation sequence standing in for one the engine admitted: a two-token prompt, greedy,
streamed, its answers dropped; for the tests of the sequence table and of what a generate
model's queue publishes. Call on a running event loop (its `done` is the loop's future)."""

from __future__ import annotations

import asyncio

import torch

from app.engine.generation_sequences import GenerationSequence
from app.engine.protocol import GeneratePayload, SamplingParams, Submit


def stand_in_sequence(
    max_new_tokens: int,
    model: str = "tiny",
    stop_token_ids: tuple[int, ...] = (),
    logprobs: int | None = None,
) -> GenerationSequence:
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, logprobs=logprobs
    )
    return GenerationSequence(
        request=Submit(1, model, 1e12, GeneratePayload([1, 5], sampling)),
        prompt=[1, 5],
        sampling=sampling,
        streams=True,
        emit=lambda message: None,
        generator=torch.Generator(),
        arrived=0.0,
        done=asyncio.get_running_loop().create_future(),
        arrival_trace=None,
    )
