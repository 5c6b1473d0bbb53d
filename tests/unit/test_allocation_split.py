"""A batch is split in halves wherever an allocation failed (`batch_triage.allocation_failed`),
for embedding and tensor models alike (`execute.split_on_allocation_failure`). Only torch's
`OutOfMemoryError` was split, and only for embeddings: torch's words for an allocation that
failed in a plain `RuntimeError` ("CUDA error: out of memory", CUBLAS_STATUS_ALLOC_FAILED, the
CPU allocator's "can't allocate memory") failed every request of the batch 500, and a tensor
model's batch was never split."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
import torch

from app.buffers import BufferPool
from app.engine.core import EngineCore
from app.engine.protocol import (
    Output,
    Submit,
    TensorData,
    TensorOutput,
    TensorPayload,
)
from app.execute import run_batch
from app.metrics import Metrics
from app.model_specs import ModelSpec, TensorSpec
from app.models.tensor import TensorModel
from app.scheduler import BatchPolicy, BatchShape
from app.settings import Settings
from tests.support.stand_in_engine import final_answer


class ModelLibraryError(Exception):
    """A model library's own exception, raised from torch's."""


def wrapped_out_of_memory() -> Exception:
    try:
        raise RuntimeError("CUDA error: out of memory")
    except RuntimeError as error:
        wrapped = ModelLibraryError("forward failed")
        wrapped.__cause__ = error
        return wrapped


ALLOCATION_FAILURES: dict[str, Callable[[], Exception]] = {
    "torch-oom": lambda: torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"),
    "cuda-runtime": lambda: RuntimeError("CUDA error: out of memory"),
    "cublas": lambda: RuntimeError(
        "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
    ),
    "cpu-allocator": lambda: RuntimeError(
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 1073741824 bytes. "
        "Error code 12 (Cannot allocate memory)"
    ),
    "wrapped": wrapped_out_of_memory,
}
POLICY = BatchPolicy(length_buckets=(8,), max_batch_size=4, max_batch_tokens=64, max_wait_s=0)


class TightRunner:
    """Each row's output is (its tokens' sum, its token count); a batch of more than one
    real row (a padding row holds one token) raises `error()`."""

    name = "tight"
    task = "embed"
    device = torch.device("cpu")
    dtype = torch.float32
    max_input_tokens = 8
    output_width = 2
    pad_token_id = 0

    def __init__(self, error: Callable[[], Exception]) -> None:
        self.error = error
        self.batch_rows: list[int] = []  # the real rows of each batch it was given

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        real = int((attention_mask.sum(dim=1) > 1).sum())
        self.batch_rows.append(real)
        if real > 1:
            raise self.error()
        kept = input_ids * attention_mask
        return torch.stack([kept.sum(dim=1), attention_mask.sum(dim=1)], dim=1).float()


def run_tight(runner: TightRunner, token_ids: list[list[int]]) -> list[list[float]]:
    pool = BufferPool(POLICY.shapes(), runner.output_width, runner.device, 1)
    output = run_batch(
        pool,
        runner,  # type: ignore[arg-type]
        BatchShape(4, 8),
        token_ids,
        None,
        lambda rows: BatchShape(POLICY.padded_batch(8, rows), 8),
    )
    assert output.timings.compute_s > 0
    rows: list[list[float]] = output.rows.tolist()
    return rows


@pytest.mark.parametrize("error", ALLOCATION_FAILURES.values(), ids=ALLOCATION_FAILURES.keys())
def test_an_embedding_batch_is_split_wherever_an_allocation_failed(
    error: Callable[[], Exception],
) -> None:
    runner = TightRunner(error)
    rows = run_tight(runner, [[1, 2], [3, 4, 5], [6, 7], [8, 9, 10, 11]])
    assert rows == [[3.0, 2.0], [12.0, 3.0], [13.0, 2.0], [38.0, 4.0]]
    # The batch, its halves, then each row alone.
    assert runner.batch_rows == [4, 2, 1, 1, 2, 1, 1]


def test_an_error_that_is_no_allocation_s_is_not_split() -> None:
    """The model's own error, whose text merely says memory: the batch fails, for triage."""
    runner = TightRunner(lambda: ValueError("out of memory, says the model"))
    with pytest.raises(ValueError):
        run_tight(runner, [[1, 2], [3, 4]])
    assert runner.batch_rows == [2]


class TightModule(torch.nn.Module):
    """Doubles its input; a batch of more than one non-zero row (padding rows are zeros)
    raises "CUDA error: out of memory", as torch raises it, a plain `RuntimeError`."""

    def __init__(self) -> None:
        super().__init__()
        self.batch_rows: list[int] = []

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        real = int((features != 0).any(dim=1).sum())
        self.batch_rows.append(real)
        if real > 1:
            raise RuntimeError("CUDA error: out of memory")
        return features * 2


X = TensorSpec(name="x", datatype="FP32", shape=(-1, 2))
Y = TensorSpec(name="y", datatype="FP32", shape=(-1, 2))
TENSOR_SETTINGS = Settings(
    models=(ModelSpec(name="t", task="tensor", source="/t.pt2", inputs=(X,), outputs=(Y,)),),
    max_wait_ms=0,
    max_batch_size=4,
    warmup=False,
    spike_reports=False,
    dispatcher_threads=1,
    torch_threads=1,
)


@pytest.fixture
async def tensor_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[tuple[EngineCore, TightModule]]:
    module = TightModule()

    def load(spec: ModelSpec, device: torch.device) -> TensorModel:
        return TensorModel(spec.name, module, device, spec.inputs, spec.outputs)

    monkeypatch.setattr("app.engine.tensor_host.load_tensor_model", load)
    core = EngineCore(TENSOR_SETTINGS, Metrics())
    await core.start()
    assert core.ready
    try:
        yield core, module
    finally:
        await core.stop()


async def test_a_tensor_batch_is_split_where_an_allocation_failed(
    tensor_engine: tuple[EngineCore, TightModule],
) -> None:
    core, module = tensor_engine
    features = np.arange(1, 9, dtype=np.float32).reshape(4, 2)
    payload = TensorPayload([TensorData("x", "FP32", [4, 2], features.tobytes())])
    answered = await final_answer(core, Submit(1, "t", time.monotonic() + 30, payload))
    assert isinstance(answered, Output), answered
    assert isinstance(answered.payload, TensorOutput)
    [y] = answered.payload.outputs
    doubled = np.frombuffer(y.data, dtype=np.float32).reshape(y.shape)
    assert doubled.tolist() == (features * 2).tolist()
    assert module.batch_rows == [4, 2, 1, 1, 2, 1, 1]
