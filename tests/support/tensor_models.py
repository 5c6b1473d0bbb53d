"""Small torch modules exported for the `tensor` task, and their STEADY_MODELS specs.

- `mlp`: Linear(8, 16) -> ReLU -> Linear(16, 4) over [batch, 8] FP32, a torch.export `.pt2`;
- `mlp16`: the same weights in half precision (FP16 in and out), `.pt2`;
- `mlp_ts`: the FP32 module as TorchScript;
- `typed`: INT64 and BOOL [batch, time] and BF16 [batch, 1] in, INT64, BF16, BOOL out;
- `seq`: [batch, time, 4] FP32 with a dynamic time dimension -> `doubled` [batch, time, 4]
  and `total` [batch, 4] (the sum over time: zero padding leaves it unchanged), `.pt2`;
- `lookup`: INT64 ids [batch, time] into an Embedding(10, 4), summed over time -> FP32
  [batch, 4]: an id of 10 or more (or below 0) makes the model itself throw, a
  RuntimeError raised on the host by its own check, on any device, `.pt2`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.second = torch.nn.Linear(16, 4)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(features)))


class Sequence(torch.nn.Module):
    def forward(self, frames: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return frames * 2.0, frames.sum(dim=1)


class Typed(torch.nn.Module):
    """INT64 ids and a BOOL mask with a dynamic length, and a BF16 scale: the kept ids'
    sum (zero padding and a False-padded mask leave it unchanged), the scale doubled, and
    whether any id was kept."""

    def forward(
        self, ids: torch.Tensor, mask: torch.Tensor, scale: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        kept = torch.where(mask, ids, torch.zeros_like(ids))
        return kept.sum(dim=1), scale * 2, mask.any(dim=1)


class Lookup(torch.nn.Module):
    """Throws on an id outside its table by checking the ids first (exported as runtime
    asserts on the ids' `.item()`, on the host), never by indexing past the table: on CUDA
    that is a device-side assert, which is no error of the request's but leaves the whole
    process's CUDA context unusable (every later batch, test and seed fails)."""

    def __init__(self) -> None:
        super().__init__()
        # Row 0 is zeros: the zero padding to a length bucket adds nothing to the sum.
        self.table = torch.nn.Embedding(LOOKUP_ROWS, 4, padding_idx=0)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        torch._check(ids.min().item() >= 0, lambda: "an id below 0")
        torch._check(ids.max().item() < LOOKUP_ROWS, lambda: "an id past the table")
        return self.table(ids).sum(dim=1)


LOOKUP_ROWS = 10


@dataclass(frozen=True)
class TensorModels:
    """The exported files' specs (for STEADY_MODELS) and the modules to call directly."""

    specs: list[dict[str, Any]]
    mlp: MLP
    mlp16: MLP
    sequence: Sequence
    typed: Typed
    lookup: Lookup


def _mlp_spec(name: str, source: Path, datatype: str) -> dict[str, Any]:
    return {
        "name": name,
        "task": "tensor",
        "source": str(source),
        "inputs": [{"name": "features", "datatype": datatype, "shape": [-1, 8]}],
        "outputs": [{"name": "scores", "datatype": datatype, "shape": [-1, 4]}],
    }


def build_tensor_models(directory: Path) -> TensorModels:
    torch.manual_seed(0)
    mlp = MLP().eval()
    mlp16 = MLP().eval()
    mlp16.load_state_dict(mlp.state_dict())
    mlp16 = mlp16.half()
    sequence = Sequence().eval()
    lookup = Lookup().eval()
    batch = torch.export.Dim("batch", min=1, max=1024)
    time = torch.export.Dim("time", min=1, max=1024)
    exported = {
        "mlp.pt2": torch.export.export(mlp, (torch.randn(2, 8),), dynamic_shapes=({0: batch},)),
        "mlp16.pt2": torch.export.export(
            mlp16, (torch.randn(2, 8).half(),), dynamic_shapes=({0: batch},)
        ),
        "seq.pt2": torch.export.export(
            sequence, (torch.randn(2, 3, 4),), dynamic_shapes=({0: batch, 1: time},)
        ),
        "typed.pt2": torch.export.export(
            Typed(),
            (
                torch.ones(2, 3, dtype=torch.int64),
                torch.ones(2, 3, dtype=torch.bool),
                torch.ones(2, 1, dtype=torch.bfloat16),
            ),
            dynamic_shapes=({0: batch, 1: time}, {0: batch, 1: time}, {0: batch}),
        ),
        "lookup.pt2": torch.export.export(
            lookup, (torch.ones(2, 3, dtype=torch.int64),), dynamic_shapes=({0: batch, 1: time},)
        ),
    }
    for file_name, program in exported.items():
        torch.export.save(program, directory / file_name)
    with warnings.catch_warnings():  # TorchScript is deprecated, and still served
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.save(torch.jit.script(mlp), str(directory / "mlp.ts"))
    specs = [
        _mlp_spec("mlp", directory / "mlp.pt2", "FP32"),
        _mlp_spec("mlp16", directory / "mlp16.pt2", "FP16"),
        _mlp_spec("mlp_ts", directory / "mlp.ts", "FP32"),
        {
            "name": "seq",
            "task": "tensor",
            "source": str(directory / "seq.pt2"),
            "inputs": [{"name": "frames", "datatype": "FP32", "shape": [-1, -1, 4]}],
            "outputs": [
                {"name": "doubled", "datatype": "FP32", "shape": [-1, -1, 4]},
                {"name": "total", "datatype": "FP32", "shape": [-1, 4]},
            ],
        },
        {
            "name": "typed",
            "task": "tensor",
            "source": str(directory / "typed.pt2"),
            "inputs": [
                {"name": "ids", "datatype": "INT64", "shape": [-1, -1]},
                {"name": "mask", "datatype": "BOOL", "shape": [-1, -1]},
                {"name": "scale", "datatype": "BF16", "shape": [-1, 1]},
            ],
            "outputs": [
                {"name": "total", "datatype": "INT64", "shape": [-1]},
                {"name": "doubled", "datatype": "BF16", "shape": [-1, 1]},
                {"name": "any", "datatype": "BOOL", "shape": [-1]},
            ],
        },
    ]
    specs.append(
        {
            "name": "lookup",
            "task": "tensor",
            "source": str(directory / "lookup.pt2"),
            "inputs": [{"name": "ids", "datatype": "INT64", "shape": [-1, -1]}],
            "outputs": [{"name": "summed", "datatype": "FP32", "shape": [-1, 4]}],
        }
    )
    return TensorModels(specs, mlp, mlp16, sequence, Typed(), lookup)
