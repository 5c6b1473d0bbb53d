"""`dtype: auto`: the checkpoint's own dtype and the device decide (a bf16-trained model
loaded in fp16 on CUDA overflowed to inf, then NaN logits, and greedy decoding emitted token
0 until max_new_tokens); both loaders read it from the model's directory."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from app.engine import generation_loading
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.models import base, causal_lm
from app.models.base import auto_dtype, declared_dtype, resolve_dtype
from app.settings import Settings
from app.startup import load_runner

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize(
    "declared,device,native,expected",
    [
        ("bfloat16", "cuda", True, torch.bfloat16),
        ("float32", "cuda", True, torch.bfloat16),
        (None, "cuda", True, torch.bfloat16),
        ("float16", "cuda", True, torch.float16),
        # No native bf16 (V100, T4): a bf16-trained model overflows fp16, so fp32; a model
        # declaring fp32 or nothing (BERT-era) in fp16, as before.
        ("bfloat16", "cuda", False, torch.float32),
        ("float32", "cuda", False, torch.float16),
        (None, "cuda", False, torch.float16),
        ("float16", "cuda", False, torch.float16),
        # The CPU as before: bf16 where native, else fp32, whatever the checkpoint says.
        ("bfloat16", "cpu", True, torch.bfloat16),
        ("float16", "cpu", True, torch.bfloat16),
        (None, "cpu", True, torch.bfloat16),
        ("bfloat16", "cpu", False, torch.float32),
        ("float16", "cpu", False, torch.float32),
        (None, "cpu", False, torch.float32),
    ],
)
def test_auto_follows_the_checkpoint_and_the_device(
    declared: str | None, device: str, native: bool, expected: torch.dtype
) -> None:
    assert auto_dtype(declared, device, native) == expected


def write_config(directory: Path, config: dict[str, Any]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize(
    "config,expected",
    [
        ({"dtype": "bfloat16"}, "bfloat16"),  # transformers 5
        ({"torch_dtype": "float16"}, "float16"),  # before it
        ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),
        ({"text_config": {"dtype": "bfloat16"}}, "bfloat16"),  # a multimodal model's
        ({"dtype": "auto"}, None),
        ({"model_type": "bert"}, None),
    ],
)
def test_the_declared_dtype_is_read_from_config_json(
    tmp_path: Path, config: dict[str, Any], expected: str | None
) -> None:
    assert declared_dtype(write_config(tmp_path, config)) == expected
    assert declared_dtype(tmp_path / "nothing here") is None


def test_requested_dtypes_are_kept(tmp_path: Path) -> None:
    directory = write_config(tmp_path, {"dtype": "bfloat16"})
    assert resolve_dtype("float16", CUDA, directory) == torch.float16
    assert resolve_dtype("float32", torch.device("cpu"), directory) == torch.float32


@pytest.fixture
def gpu_with_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(base, "cpu_supports_bf16", lambda: False)


class Recorded:
    """Stands in for a runner class: keeps the dtype it was made with."""

    dtypes: list[torch.dtype]

    def __init__(self, *args: object, **kwargs: object) -> None:
        dtype = kwargs.get("dtype", next((a for a in args if isinstance(a, torch.dtype)), None))
        assert isinstance(dtype, torch.dtype)
        Recorded.dtypes.append(dtype)
        self.cache = SimpleNamespace(bytes_allocated=0)


@pytest.mark.parametrize(
    "declared,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
def test_the_embedding_loader_reads_the_checkpoints_dtype(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpu_with_bf16: None,
    declared: str,
    expected: torch.dtype,
) -> None:
    directory = write_config(tmp_path, {"model_type": "bert", "dtype": declared})
    monkeypatch.setattr("app.startup.EmbeddingRunner", Recorded)
    Recorded.dtypes = []
    load_runner(ModelSpec(name="m", source=str(directory)), CUDA, 64)
    assert Recorded.dtypes == [expected]


@pytest.mark.parametrize(
    "declared,expected", [("bfloat16", torch.bfloat16), ("float16", torch.float16)]
)
async def test_the_causal_lm_loader_reads_the_checkpoints_dtype(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    gpu_with_bf16: None,
    declared: str,
    expected: torch.dtype,
) -> None:
    directory = write_config(tmp_path, {"model_type": "llama", "torch_dtype": declared})
    monkeypatch.setattr(causal_lm, "CausalLMRunner", Recorded)
    monkeypatch.setattr(generation_loading, "GenerationHost", lambda runner, context: runner)
    Recorded.dtypes = []

    async def run_compute(function: Any, *args: object) -> object:
        return function(*args)

    context: Any = SimpleNamespace(
        settings=Settings(),
        device=CUDA,
        dispatcher=SimpleNamespace(run_compute=run_compute),
        metrics=Metrics(),
    )
    spec = ModelSpec(name="m", task="generate", source=str(directory))
    await generation_loading.load_generation_host(spec, context)
    assert Recorded.dtypes == [expected]
