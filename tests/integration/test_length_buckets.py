"""An embedding model's largest length bucket is cut to the longest input it takes: with
buckets (384, 768), the bundled MiniLM (512 positions; its sentence-transformers length
left out, so 512 is its limit) had its 385-512-token inputs padded to 768, and BertEmbeddings
failed on that shape: warm-up never finished."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel

from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import EmbedOutput, EmbedPayload, Submit
from app.metrics import Metrics
from app.model_specs import BUNDLED_DEFAULT_SOURCE, ModelSpec
from app.models.pooling import mean_pool
from app.models.source import resolve_source
from app.models.tokenizer import load_tokenizer
from app.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="module")


def minilm_taking_512_tokens(directory: Path) -> Path:
    """The bundled model's files, less the sentence-transformers length (256)."""
    directory.mkdir()
    for path in Path(resolve_source(BUNDLED_DEFAULT_SOURCE)).iterdir():
        if path.name != "sentence_bert_config.json":
            (directory / path.name).symlink_to(path)
    return directory


async def test_inputs_up_to_the_models_positions_are_served_with_a_bucket_past_them(
    tmp_path: Path,
) -> None:
    directory = minilm_taking_512_tokens(tmp_path / "minilm")
    settings = Settings(
        engine="inprocess",
        models=(ModelSpec(name="m", source=str(directory), dtype="float32"),),
        length_buckets=(384, 768),
        max_batch_size=2,
        rate_limit_burst=1_000_000,
        torch_threads=1,
        spike_reports=False,
    )
    tokenizer = load_tokenizer(str(directory), 768, None)
    assert tokenizer.max_input_tokens == 512
    [ids] = tokenizer.tokenize(["every slow request explained " * 200], truncate=True)
    assert len(ids) == 512
    engine = InProcessEngine(EngineCore(settings, Metrics()))
    await engine.start()
    try:
        await engine.wait_ready()  # warm-up ran the 512 shape, not 768
        request = Submit(engine.next_request_id(), "m", time.monotonic() + 60, EmbedPayload([ids]))
        [output] = [o async for o in engine.stream(request)]
    finally:
        await engine.close()
    assert isinstance(output.payload, EmbedOutput)
    served = np.frombuffer(output.payload.vectors, dtype=np.float32)
    model = AutoModel.from_pretrained(str(directory), dtype=torch.float32).eval()
    with torch.inference_mode():
        ids_tensor = torch.tensor([ids])
        mask = torch.ones_like(ids_tensor)
        expected = mean_pool(
            model(input_ids=ids_tensor, attention_mask=mask).last_hidden_state, mask
        )
    np.testing.assert_allclose(served, expected[0].numpy(), rtol=1e-4, atol=1e-4)
