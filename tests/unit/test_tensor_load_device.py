"""A `.pt2` program exported on the CPU runs on another device once loaded: its lifted
tensor constants and the devices baked into its graph (`torch.arange(n,
device=x.device)` traced on the CPU) move with it, not only its parameters and buffers.

The meta device stands in for CUDA (no GPU here): `program.module().to(device)` leaves
the constant and the `arange` on the CPU, and the call fails exactly as it did on CUDA
("... not on the expected device ..."); `move_to_device_pass` moves them."""

from __future__ import annotations

from pathlib import Path

import torch

from app.model_specs import ModelSpec
from app.models.tensor import load_tensor_model


class _Positioned(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        # A plain tensor attribute: torch.export lifts it as a constant, not a buffer.
        self.scale = torch.tensor([2.0, 3.0, 4.0])

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(features.shape[1], device=features.device)
        return self.linear(features) * self.scale + positions.to(features.dtype)


def _spec(source: Path) -> ModelSpec:
    return ModelSpec.model_validate(
        {
            "name": "positioned",
            "task": "tensor",
            "source": str(source),
            "inputs": [{"name": "features", "datatype": "FP32", "shape": [-1, 3]}],
            "outputs": [{"name": "scores", "datatype": "FP32", "shape": [-1, 3]}],
        }
    )


def test_a_cpu_exported_program_s_constants_and_graph_devices_follow_the_load_device(
    tmp_path: Path,
) -> None:
    path = tmp_path / "positioned.pt2"
    program = torch.export.export(_Positioned(), (torch.ones(2, 3),))
    assert program.constants, "the test model must have a lifted tensor constant"
    torch.export.save(program, str(path))
    device = torch.device("meta")

    model = load_tensor_model(_spec(path), device)
    (scores,) = model([torch.ones(2, 3, device=device)])

    assert scores.device == device
    assert scores.shape == (2, 3)
    placed = {t.device for t in model.module.state_dict().values()}
    assert placed == {device}


def test_the_program_still_runs_on_the_device_it_was_exported_on(tmp_path: Path) -> None:
    path = tmp_path / "positioned.pt2"
    module = _Positioned()
    torch.export.save(torch.export.export(module, (torch.ones(2, 3),)), str(path))

    model = load_tensor_model(_spec(path), torch.device("cpu"))
    (scores,) = model([torch.ones(2, 3)])

    assert torch.allclose(scores, module(torch.ones(2, 3)))
