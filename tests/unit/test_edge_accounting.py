"""What the front end records of a request, a front end in front of an engine double
(tests/support/edge.py): every inference route's `parse_body` phase (whether the body
parses or not), a large input tokenized off the loop and its phase marked so, and one
refusal or deadline counted per request however many prompts it has."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from fastapi import FastAPI

from app.engine.core import EngineCore
from app.engine.protocol import Failure, FailureKind, FromEngine, Submit
from app.timing import PhaseTimer
from app.tokenizer_pool import INLINE_TOKENIZE_MAX_CHARS
from tests.support.edge import SETTINGS, front_end


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        (
            "/infer",
            b'{"model": "tiny", "inputs": "hello", "parameters": {"max_new_tokens": 16}}',
            400,
        ),
        ("/infer", b'{"model": "minilm", "inputs": 5}', 422),
        ("/v1/embeddings", b'{"model": "minilm", "input": ', 400),
        ("/v1/completions", b'{"model": "tiny", "prompt": "hello", "max_tokens": 16}', 400),
        ("/v1/chat/completions", b'{"model": "tiny", "messages": "hello"}', 400),
        ("/v2/models/minilm/infer", b'{"inputs": "not a list"}', 400),
    ],
)
async def test_every_inference_route_times_its_bodys_parse_whether_it_parses_or_not(
    tmp_path: Path, path: str, body: bytes, status: int
) -> None:
    """Decoding and validating a body ran on the event loop untimed: a large body's parse
    read as the loop blocked by other work, or as time outside every phase (docs/SPIKES.md,
    `parse_body`)."""
    async with front_end(tmp_path) as (client, _, _):
        response = await client.post(
            path, content=body, headers={"content-type": "application/json"}
        )
    assert response.status_code == status, response.text
    timing = dict(entry.split(";dur=") for entry in response.headers["server-timing"].split(", "))
    # A small body parses in microseconds: the header's 10 us resolution may show 0.00.
    assert 0 <= float(timing["parse_body"]) <= float(timing["total"]), timing


async def test_a_large_input_is_tokenized_off_the_loop_and_its_phase_says_so(
    tmp_path: Path,
) -> None:
    """A slow-request report takes the request's own `tokenize` time off its loop's
    lateness only when it ran on the loop (docs/SPIKES.md)."""
    async with front_end(tmp_path) as (_, app, _):
        service = app.state.service
        small, large = PhaseTimer(), PhaseTimer()
        loop_thread = threading.get_ident()
        assert await service.run_tokenizer(10, small, threading.get_ident) == loop_thread
        chars = INLINE_TOKENIZE_MAX_CHARS + 1
        assert await service.run_tokenizer(chars, large, threading.get_ident) != loop_thread
    assert small.off_loop == set()
    assert large.off_loop == {"tokenize"}


def refused_total(app: FastAPI, model: str, reason: str) -> float:
    labels = {"model": model, "reason": reason}
    value = app.state.service.metrics.registry.get_sample_value(
        "steadyserve_rejected_total", labels
    )
    return value or 0.0


@pytest.mark.parametrize("prompts", [["hello"], ["hello", "world", "hello again"]])
async def test_a_refused_request_counts_one_refusal_however_many_prompts(
    tmp_path: Path, prompts: list[str]
) -> None:
    """Each prompt goes to the engine as a Submit of its own, and the engine counted each
    one refused: `steadyserve_rejected_total` counts requests. (The engine here is a real
    `EngineCore` not started, which refuses everything as not ready.)"""
    core: list[EngineCore] = []

    def to_the_engine(submit: Submit) -> FromEngine:
        answers: list[FromEngine] = []
        core[0].submit(b"front-end", submit, answers.append)
        [answer] = answers
        return answer

    async with front_end(tmp_path, to_the_engine) as (client, app, engine):
        core.append(EngineCore(SETTINGS, app.state.service.metrics))  # one registry for both
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": prompts, "max_tokens": 2}
        )
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "not_ready"
        assert len(engine.submitted) == len(prompts)  # the engine refused each
        assert refused_total(app, "tiny", "not_ready") == 1


async def test_a_request_whose_prompts_expire_in_the_engine_counts_one_deadline(
    tmp_path: Path,
) -> None:
    """The engine counts no expiry of a Submit its front end counts for (as for its
    refusals): the front end counts the request's one."""

    def expired(submit: Submit) -> FromEngine:
        assert submit.refusal_counted_by_sender  # the engine leaves the counting to us
        message = "deadline passed after 0 generated tokens"
        return Failure(submit.request_id, FailureKind.DEADLINE, message)

    async with front_end(tmp_path, expired) as (client, app, _):
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": ["hello", "world"], "max_tokens": 2}
        )
        assert response.status_code == 504
        assert refused_total(app, "tiny", "deadline") == 1
