"""What every model runner offers, and how device, dtype and weights are resolved."""

from __future__ import annotations

import json
import logging
from pathlib import Path
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


def declared_dtype(directory: Path) -> str | None:
    """The dtype the checkpoint says it was trained and saved in (config.json's `dtype`, or
    `torch_dtype` before transformers 5; a multimodal model's text config's), or None."""
    path = directory / "config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    text_config = config.get("text_config")
    for scope in (config, text_config if isinstance(text_config, dict) else {}):
        for key in ("dtype", "torch_dtype"):
            value = scope.get(key)
            if isinstance(value, str) and value != "auto":
                return value.removeprefix("torch.")
    return None


def auto_dtype(declared: str | None, device_type: str, bf16_native: bool) -> torch.dtype:
    """What `auto` loads a model in (pure). On CUDA: bf16 where the GPU runs it natively,
    unless the checkpoint declares fp16; fp16 for those; on GPUs without bf16, fp32 for a
    checkpoint declaring bf16, else fp16. A model trained in bf16 or fp32 (or one that does
    not say) may have activations past fp16's 65504: in fp16 they overflow to inf, then NaN
    logits. On a CPU: bf16 where native, else fp32, whatever the checkpoint declares (bf16's
    range holds an fp16 model's)."""
    if device_type == "cuda":
        if declared == "float16":
            return torch.float16
        if bf16_native:
            return torch.bfloat16
        # No bf16 (a T4, a V100): a bf16-trained model overflows fp16, so it runs in fp32;
        # one declaring fp32 or nothing (BERT-era models) in fp16, as it always has.
        return torch.float32 if declared == "bfloat16" else torch.float16
    return torch.bfloat16 if bf16_native else torch.float32


def resolve_dtype(requested: Dtype, device: torch.device, directory: Path) -> torch.dtype:
    """The dtype to load the model in `directory` in (`auto_dtype` for `auto`); on CUDA,
    call it where CUDA may be initialised (a compute thread, after start-up's)."""
    if requested != "auto":
        dtype: torch.dtype = getattr(torch, requested)
        return dtype
    if device.type == "cuda":
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return auto_dtype(declared_dtype(directory), device.type, native)
    return auto_dtype(None, device.type, cpu_supports_bf16())
