"""A token-id prompt's ids are held to the model's embedding as well as to its tokenizer:
a fine-tune that added tokens without resizing its embedding took an id between the two,
and on CUDA the lookup's device-side assert lost the device (every request in the engine
failed, and the engine restarted, at each such request)."""

from __future__ import annotations

import pytest

from app.engine.protocol import ModelInfo
from app.main import create_app
from app.model_specs import ModelSpec
from app.settings import Settings
from tests.support.asgi import serving
from tests.support.scripted_generator import ScriptedGenerator

pytestmark = pytest.mark.asyncio(loop_scope="module")

EMBEDDING_ROWS = 100  # fewer than the tiny tokenizer's tokens


class SmallEmbedding(ScriptedGenerator):
    def model_info(self, spec: ModelSpec) -> ModelInfo:
        info = super().model_info(spec)
        if spec.task != "generate":
            return info
        return ModelInfo(info.task, EMBEDDING_ROWS, info.max_input_tokens)


async def test_an_id_past_the_model_s_embedding_is_a_400_before_the_engine(
    settings: Settings,
) -> None:
    engine = SmallEmbedding(settings)
    application = create_app(settings, engine=engine)
    async with serving(application) as client:
        tokens = application.state.generation.tokenizer("tiny").vocabulary_size
        assert tokens > EMBEDDING_ROWS + 1
        body = {"model": "tiny", "max_tokens": 1}
        served = await client.post("/v1/completions", json={**body, "prompt": [1, 99]})
        refused = await client.post("/v1/completions", json={**body, "prompt": [1, 100]})
    assert served.status_code == 200, served.text
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert "token id 100" in error["message"] and "ids 0 to 99" in error["message"]
    assert len(engine.submitted) == 1  # the refused one never reached the engine
