"""A generation sequence standing in for one the engine admitted: a two-token prompt (or
`prompt`), greedy, streamed, its answers dropped; for the tests of the sequence table, of
what a generate model's queue publishes and of what a sequence sends. Call on a running
event loop (its `done` is the loop's future)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import torch

from app.engine.generation_sequences import GenerationSequence
from app.engine.protocol import GeneratePayload, SamplingParams, Submit


def stand_in_sequence(
    max_new_tokens: int,
    model: str = "tiny",
    stop_token_ids: tuple[int, ...] = (),
    logprobs: int | None = None,
    *,
    prompt: Sequence[int] = (1, 5),
    prompt_logprobs: int | None = None,
    streams: bool = True,
    slot: int | None = None,
) -> GenerationSequence:
    sampling = SamplingParams(
        max_new_tokens=max_new_tokens,
        stop_token_ids=stop_token_ids,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
    )
    return GenerationSequence(
        request=Submit(1, model, 1e12, GeneratePayload(list(prompt), sampling)),
        prompt=list(prompt),
        sampling=sampling,
        streams=streams,
        emit=lambda message: None,
        generator=torch.Generator(),
        arrived=0.0,
        done=asyncio.get_running_loop().create_future(),
        arrival_trace=None,
        slot=slot,
    )
