"""Generation over real HTTP with the tiny random-weight causal LM and the real engine, in
process: a client that disconnects mid-stream frees its cache at once (a request needing
the whole cache succeeds right after), and the sequence stops long before its max_tokens.
The server is uvicorn on 127.0.0.1 in the test's loop (tests/support/listening.py)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
import orjson
import pytest

from app.main import create_app
from tests.support.generation_api import SLOT_TOKENS, settings_for
from tests.support.listening import listening

pytestmark = pytest.mark.asyncio(loop_scope="module")


def _metric(text: str, name: str, model: str = "tiny", extra: str = "") -> float:
    pattern = rf'^{name}\{{[^}}]*model="{model}"[^}}]*{extra}[^}}]*\}} (\S+)$'
    return sum(float(value) for value in re.findall(pattern, text, re.M))


async def test_a_client_that_disconnects_mid_stream_frees_its_cache(
    tiny_causal_lm: Path, tiny_causal_lm_without_chat_template: Path
) -> None:
    """One slot and a delay budget far below a long sequence's time: while the slot is held a
    request for it is refused, so the one after the disconnect succeeding shows the slot was
    freed; and the disconnected sequence stopped long before its max_tokens."""
    settings = settings_for(
        tiny_causal_lm,
        tiny_causal_lm_without_chat_template,
        "inprocess",  # its engine metrics are on this app's /metrics
        generate_slots=1,
        max_queue_delay_ms=20,
    )
    long = {"model": "tiny", "prompt": "Once upon a time", "temperature": 0, "stream": True}
    long["max_tokens"] = SLOT_TOKENS - 8
    async with listening(create_app(settings)) as url, httpx.AsyncClient(base_url=url) as client:
        async with client.stream("POST", "/v1/completions", json=long) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: ") and orjson.loads(line[6:])["choices"][0]["text"]:
                    break  # one piece of text arrived: leave mid-stream
            # While it holds the slot, a stream asking for it is refused before it starts:
            # a plain 429 with Retry-After, not an event stream.
            refused = await client.post("/v1/completions", json={**long, "max_tokens": 4})
            assert refused.status_code == 429, refused.text
            assert refused.headers["content-type"] == "application/json"
            assert int(refused.headers["retry-after"]) >= 1
        running = 1.0
        for _ in range(500):  # the server notices the closed socket on its next loop turns
            metrics = (await client.get("/metrics")).text
            running = _metric(metrics, "steadyserve_sequences", extra='state="running"')
            if running == 0:
                break
        assert running == 0
        generated = _metric(metrics, "steadyserve_output_tokens_total")
        assert generated < long["max_tokens"] / 2, generated  # cancelled, not run out
        whole = {"model": "tiny", "prompt": "Hello", "max_tokens": SLOT_TOKENS - 8}
        after = await client.post("/v1/completions", json=whole, timeout=60)
        assert after.status_code == 200, after.text
