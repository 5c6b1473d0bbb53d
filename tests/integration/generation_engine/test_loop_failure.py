"""A generation loop that fails (a bug of the server's, between steps) fails the sequences it
held with a 500 whose message names the request's reference and the error's class, never the
error's text (which may hold a prompt), and logs the text under those references."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from app.engine.generation_host import GenerationHost
from app.engine.generation_sequences import GenerationSequence
from app.engine.protocol import SamplingParams
from tests.support.generation_engine import collect, settings_for, started, submit

pytestmark = pytest.mark.asyncio(loop_scope="module")

SECRET = "the prompt was: my password is hunter2"


async def test_a_failed_loop_answers_its_sequences_without_the_error_s_text(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    engine = await started(settings_for(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    original = host._next_step
    raised: list[RuntimeError] = []

    def fail_once_it_runs() -> list[GenerationSequence]:
        if host._batch.running and not raised:
            raised.append(RuntimeError(SECRET))
            raise raised[0]
        return original()

    monkeypatch.setattr(host, "_next_step", fail_once_it_runs)
    request = submit(engine, [1, 40, 41], SamplingParams(max_new_tokens=20))
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(Exception) as failed:
            await collect(engine.stream(request))
    finally:
        await engine.close()
    assert raised, "the loop never failed with the sequence in it"
    message = str(failed.value)
    assert SECRET not in message
    assert "RuntimeError" in message and "generation loop" in message
    reference = message.rsplit("under request ", 1)[1]
    logged = [r for r in caplog.records if "generation loop failed" in r.getMessage()]
    assert logged and reference in logged[0].getMessage()
    assert logged[0].exc_info is not None and SECRET in str(logged[0].exc_info[1])
