"""What a `tensor` model is checked for before it serves, each on a model and engine of its
own: a state dict is refused at load, naming the model and what it needed; an output
whose dtype is not its spec's fails warm-up. The test models (`models`) come from
tests/integration/conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.engine.client import EngineUnavailable
from app.engine.core import EngineCore
from app.engine.inprocess import InProcessEngine
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.models.tensor import load_tensor_model
from app.settings import Settings
from tests.support.tensor_models import TensorModels

pytestmark = pytest.mark.asyncio(loop_scope="module")


async def test_a_state_dict_is_refused_at_load_naming_the_model_and_what_it_needed(
    tmp_path: Path,
) -> None:
    path = tmp_path / "weights.pt"
    torch.save({"weight": torch.zeros(2, 2)}, path)
    spec = ModelSpec.model_validate(
        {
            "name": "scorer",
            "task": "tensor",
            "source": str(path),
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        }
    )
    with pytest.raises(ValueError, match=r"scorer: .* is not a TorchScript file"):
        load_tensor_model(spec, torch.device("cpu"))


async def test_an_output_whose_dtype_is_not_its_spec_s_fails_warm_up(
    models: TensorModels, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the shape was checked: `copy_` turned float scores declared INT64 into
    truncated integers, served as the model's answer."""
    mlp = next(s for s in models.specs if s["name"] == "mlp")
    spec = {**mlp, "outputs": [{"name": "scores", "datatype": "INT64", "shape": [-1, 4]}]}
    settings = Settings(
        engine="inprocess",
        models=(ModelSpec.model_validate(spec),),
        length_buckets=(4,),
        max_batch_size=2,
        torch_threads=1,
    )
    engine = InProcessEngine(EngineCore(settings, Metrics()))
    await engine.start()
    try:
        with pytest.raises(EngineUnavailable, match="start-up failed: ValueError"):
            await engine.wait_ready()
    finally:
        await engine.close()
    assert "output 'scores' is torch.float32; its spec gives INT64" in caplog.text
