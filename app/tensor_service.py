"""The front end's pipeline for `tensor` models: check the tensors against the model's
declared inputs, then the same admission, deadline and engine round trip as every task
(`Service.begin` and `Service.compute`). Torch-free; front end's event loop thread only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from app.engine.protocol import TensorData, TensorOutput, TensorPayload
from app.service import Service
from app.tensors import RequestShape, TensorError, check_request, check_size
from app.timing import PhaseTimer


@dataclass(frozen=True, slots=True)
class SentTensor:
    """One input as a client sent it, already as bytes (row-major, little-endian)."""

    datatype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class CheckedTensors:
    payload: TensorPayload
    shape: RequestShape


def check_tensors(
    service: Service, model: str, tensors: Mapping[str, SentTensor]
) -> CheckedTensors:
    """The payload for `model`'s engine; raises `WrongTask` or `TensorError` (400, naming
    the input at fault) before anything is queued."""
    spec = service.require_task(model, "tensor")
    shape = check_request(spec.inputs, {n: (t.datatype, t.shape) for n, t in tensors.items()})
    settings = service.settings
    if shape.rows > settings.max_inputs_per_request:
        raise TensorError(
            f"{shape.rows} rows in the batch dimension; at most "
            f"{settings.max_inputs_per_request} per request"
        )
    if any(t.dynamic for t in spec.inputs) and shape.length > settings.length_buckets[-1]:
        raise TensorError(
            f"a dynamic dimension of {shape.length} exceeds the largest length bucket "
            f"({settings.length_buckets[-1]})"
        )
    for name, tensor in tensors.items():
        check_size(name, tensor.datatype, tensor.shape, len(tensor.data))
    inputs = [
        TensorData(
            s.name, tensors[s.name].datatype, list(tensors[s.name].shape), tensors[s.name].data
        )
        for s in spec.inputs
    ]
    return CheckedTensors(TensorPayload(inputs), shape)


async def infer_tensors(
    service: Service,
    model: str,
    checked: CheckedTensors,
    *,
    timeout_ms: float | None,
    envoy_timeout_ms: float | None,
    timer: PhaseTimer,
) -> TensorOutput:
    """Admit checked tensors (they cost rows x length tokens of the rate limit), compute
    them in the engine and return the outputs. Raises what `Service.compute` does."""
    now, deadline = service.begin(model, timeout_ms, envoy_timeout_ms)
    output = await service.compute(
        model,
        "tensor",
        checked.payload,
        cost=checked.shape.rows * checked.shape.length,
        deadline=deadline,
        arrived_at=now,
        timer=timer,
    )
    if not isinstance(output, TensorOutput):  # a server fault: answered 500
        raise TypeError(f"{model} answered tensors with {type(output)}")
    return output
