"""What every model runner offers, and how device, dtype and weights are resolved."""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from app.model_specs import Dtype
from app.settings import Device

log = logging.getLogger(__name__)


class ModelRunner(Protocol):
    """A loaded model, inside the engine. `forward` runs on compute threads only. Inputs
    arrive as token ids (front ends tokenize): `pad_token_id` pads them and
    `max_input_tokens` bounds the length buckets it needs."""

    name: str
    task: str
    device: torch.device
    dtype: torch.dtype
    max_input_tokens: int
    output_width: int
    pad_token_id: int

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Outputs of one padded batch, shape (rows, output_width), on the model's device."""
        ...


def resolve_device(requested: Device) -> torch.device:
    """The first visible GPU when asked for (or `auto` and one exists), else the CPU.

    Does not initialise CUDA: start-up does that eagerly, after setting the allocator's
    configuration, which CUDA reads once at initialisation.
    """
    if requested == "cuda" or (requested == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")


def cpu_supports_bf16() -> bool:
    """True where oneDNN runs bf16 natively (AVX512-BF16 / AMX); emulated bf16 is slower
    than fp32, so `auto` only picks it where it is native."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(requested: Dtype, device: torch.device) -> torch.dtype:
    if requested != "auto":
        dtype: torch.dtype = getattr(torch, requested)
        return dtype
    if device.type == "cuda":
        return torch.float16
    return torch.bfloat16 if cpu_supports_bf16() else torch.float32
