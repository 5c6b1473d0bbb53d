"""A pool miss's temporary slot is made on the batch's own stream.

On CUDA its device tensors are zero-filled where they are made: made outside the batch's
stream (on the default stream) those fills were unordered with the batch's non-blocking
copies in, on the dispatcher thread's stream, and a late fill could zero the inputs after
the copy. No CPU test can show a race between streams; these pin the structure instead:
the slot is built inside `torch.cuda.stream(<the batch's stream>)` (a recording fake here),
by both executors, and a preallocated slot is not rebuilt at all."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

import app.buffers as buffers_module
import app.tensor_batch as tensor_batch_module
from app.buffers import BufferPool
from app.execute import execute_batch
from app.model_specs import ModelSpec
from app.models.tensor import TensorModel
from app.scheduler import BatchShape
from app.tensor_batch import TensorRow, execute_tensor_batch, tensor_pool
from tests.unit.test_buffers import SumRunner

STREAM = object()  # the dispatcher thread's stream, as the executors are handed it


@pytest.fixture
def streams_entered(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """`torch.cuda.stream` records the streams entered and not yet left (innermost last)."""
    active: list[object] = []

    @contextmanager
    def stream(entered: object) -> Iterator[None]:
        active.append(entered)
        try:
            yield
        finally:
            active.pop()

    monkeypatch.setattr(torch.cuda, "stream", stream)
    return active


def _recording(monkeypatch: pytest.MonkeyPatch, cls: type, active: list[object]) -> list[object]:
    """The innermost stream entered when each `cls` was built (None: none was)."""
    built: list[object] = []
    original = cls.__init__

    def init(self: object, *args: object, **kwargs: object) -> None:
        built.append(active[-1] if active else None)
        original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", init)
    return built


def test_a_token_batch_s_miss_slot_is_made_on_its_stream(
    monkeypatch: pytest.MonkeyPatch, streams_entered: list[object]
) -> None:
    pool = BufferPool([BatchShape(4, 8)], 2, torch.device("cpu"), 1)
    built = _recording(monkeypatch, buffers_module.BufferSlot, streams_entered)

    output = execute_batch(pool, SumRunner(), BatchShape(2, 16), [[1, 2]], STREAM)  # type: ignore[arg-type]

    assert output.timings.pool_miss and output.rows.tolist() == [[3.0, 2.0]]
    assert built == [STREAM]
    # A preallocated slot is taken as it is: nothing is built.
    execute_batch(pool, SumRunner(), BatchShape(4, 8), [[1]], STREAM)  # type: ignore[arg-type]
    assert built == [STREAM]


class _Double(torch.nn.Module):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features * 2


def test_a_tensor_batch_s_miss_slot_is_made_on_its_stream(
    monkeypatch: pytest.MonkeyPatch, streams_entered: list[object]
) -> None:
    spec = ModelSpec.model_validate(
        {
            "name": "double",
            "task": "tensor",
            "source": "unused.pt2",
            "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
            "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        }
    )
    model = TensorModel("double", _Double(), torch.device("cpu"), spec.inputs, spec.outputs)
    pool = tensor_pool(model, [BatchShape(4, 1)], 1)
    built = _recording(monkeypatch, tensor_batch_module.TensorSlot, streams_entered)
    row = TensorRow((np.array([1.0, 2.0], dtype=np.float32),), 1)

    output = execute_tensor_batch(pool, model, BatchShape(2, 1), [row], STREAM)  # type: ignore[arg-type]

    assert output.timings.pool_miss and output.row(0)[0].tolist() == [2.0, 4.0]
    assert built == [STREAM]
