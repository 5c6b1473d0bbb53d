"""A `tensor` model: a torch.export program (`.pt2`) or a TorchScript file, called with its
declared inputs in order, returning its declared outputs in order.

Loading blocks (compute threads only); `__call__` runs on compute threads only.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.export.passes import move_to_device_pass

from app.model_specs import ModelSpec, TensorSpec

log = logging.getLogger(__name__)

TORCH_DTYPES: dict[str, torch.dtype] = {
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "INT64": torch.int64,
    "BOOL": torch.bool,
}


class TensorModel:
    def __init__(
        self,
        name: str,
        module: torch.nn.Module,
        device: torch.device,
        inputs: tuple[TensorSpec, ...],
        outputs: tuple[TensorSpec, ...],
    ) -> None:
        self.name = name
        self.task = "tensor"
        self.module = module
        self.device = device
        self.inputs = inputs
        self.outputs = outputs

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """The model's outputs for one padded batch, in the spec's order; raises
        `ValueError` when it returns another number of tensors."""
        with torch.inference_mode():
            result = self.module(*inputs)
        tensors = list(result) if isinstance(result, (tuple, list)) else [result]
        if len(tensors) != len(self.outputs) or not all(
            isinstance(t, torch.Tensor) for t in tensors
        ):
            raise ValueError(
                f"{self.name} returned {len(tensors)} values; its spec declares "
                f"{len(self.outputs)} output tensors"
            )
        return tensors


def load_tensor_model(spec: ModelSpec, device: torch.device) -> TensorModel:
    """Load `spec.source`: a `.pt2` file is a torch.export program, anything else a
    TorchScript file (compute threads only: it blocks)."""
    path = Path(spec.source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"{spec.name}: no model file at {path}")
    module: torch.nn.Module
    kind = "torch.export program (.pt2)" if path.suffix == ".pt2" else "TorchScript file"
    try:
        if path.suffix == ".pt2":
            # Not `program.module().to(device)`: that moves parameters and buffers only,
            # leaving lifted tensor constants and devices baked into the graph
            # (`torch.arange(n, device=x.device)` traced on the CPU) where they were.
            program = move_to_device_pass(torch.export.load(str(path)), device)
            module = program.module()
        else:
            module = torch.jit.load(  # type: ignore[no-untyped-call]
                str(path), map_location=device
            ).eval()
    except Exception as error:  # a state_dict, a pickle, a truncated file...
        raise ValueError(
            f"{spec.name}: {path} is not a {kind} (a state_dict cannot be served): {error}"
        ) from error
    log.info("%s: loaded %s on %s", spec.name, path.name, device)
    return TensorModel(spec.name, module, device, spec.inputs, spec.outputs)
