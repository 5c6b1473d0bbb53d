"""Driving the `generate` task of an in-process engine over the tiny random-weight causal
LM (tests/integration/generation_engine/): its settings (8 KV-cache slots of 256 tokens),
an engine started and ready, one request's outputs collected, and `model.generate`'s
greedy answer to compare them with, and the tiny model with one more EOS token. Event loop
thread only."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedModel

from app.engine.core import EngineCore
from app.engine.generation_host import GenerationHost
from app.engine.generation_steps import StepResult
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import (
    FinishReason,
    GeneratePayload,
    Output,
    SamplingParams,
    Submit,
    TokensOutput,
)
from app.metrics import Metrics
from app.settings import Settings
from loadtest.tiny_causal_lm import build_tiny_causal_lm
from tests.support.generation import generate_settings, reference_greedy

SLOTS = 8
SLOT_TOKENS = 256


def settings_for(source: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {"engine": "inprocess", **overrides}
    return generate_settings({"tiny": source}, slots=SLOTS, slot_tokens=SLOT_TOKENS, **values)


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    finish_reason: FinishReason | None
    outputs: int
    prompt_tokens: int
    sizes: tuple[int, ...] = ()  # tokens in each output, in order


async def started(settings: Settings) -> InProcessEngine:
    engine = InProcessEngine(EngineCore(settings, Metrics()))
    await engine.start()
    await engine.wait_ready()
    return engine


async def started_on_clock(
    source: Path, clock: Callable[[], float]
) -> tuple[InProcessEngine, GenerationHost]:
    """An engine serving the tiny model at `source` (no warm-up) on `clock`, and its
    generation host."""
    core = EngineCore(settings_for(source, warmup=False), Metrics(), clock=clock)
    engine = InProcessEngine(core)
    await engine.start()
    await engine.wait_ready()
    host = core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    return engine, host


async def generate(
    engine: InProcessEngine, prompt_ids: list[int], sampling: SamplingParams, stream: bool = True
) -> Generated:
    request = Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 120,
        GeneratePayload(prompt_ids, sampling, stream=stream),
    )
    return await collect(engine.stream(request))


async def collect(stream: AsyncIterator[Output]) -> Generated:
    tokens: list[int] = []
    sizes: list[int] = []
    finish = None
    prompt_tokens = -1
    async for output in stream:
        payload = output.payload
        assert isinstance(payload, TokensOutput)
        tokens.extend(payload.token_ids)
        sizes.append(len(payload.token_ids))
        finish = payload.finish_reason
        prompt_tokens = payload.prompt_tokens
    return Generated(tokens, finish, len(sizes), prompt_tokens, tuple(sizes))


def submit(engine: InProcessEngine, prompt_ids: list[int], sampling: SamplingParams) -> Submit:
    return Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 120,
        GeneratePayload(prompt_ids, sampling),
    )


def expected_greedy(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int
) -> Generated:
    """model.generate on one prompt, no padding; the EOS token is not part of the result."""
    result = reference_greedy(model, prompt_ids, max_new_tokens)
    finish = FinishReason.EOS if result.at_eos else FinishReason.LENGTH
    return Generated(result.token_ids, finish, 0, len(prompt_ids))


def tiny_model_that_also_ends_at(directory: Path, stop: int) -> Path:
    """The tiny model with `stop` among its EOS tokens (a generation config may name
    several), written to `directory`."""
    build_tiny_causal_lm(directory)
    config_path = directory / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], stop]
    config_path.write_text(json.dumps(config))
    return directory


def record_runs(
    engine: InProcessEngine, model: str = "tiny", only_while: Callable[[], bool] = lambda: True
) -> list[int]:
    """The decode steps each of `model`'s generation dispatches ran (1: a single step;
    more: a multi-step run), in order, as its host records their times; those that ended
    while `only_while()` held."""
    host = engine.core.hosts[model]
    assert isinstance(host, GenerationHost)
    runs: list[int] = []
    record = host._record_step

    def recording(result: StepResult) -> None:
        if only_while():
            runs.append(result.steps)
        record(result)

    host._record_step = recording  # type: ignore[method-assign]
    return runs
