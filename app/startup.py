"""What start-up needs besides the `Service` itself: loading a model, the batch policy a
loaded model gets, eager CUDA initialisation (and the allocator configuration it reads).

`load_runner` and `init_cuda` block (seconds) and run on dispatcher compute threads only;
the rest is called from the event loop thread.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from app.model_specs import ModelSpec
from app.models.base import ModelRunner, resolve_dtype
from app.models.embedding import EmbeddingRunner
from app.models.source import local_directory
from app.scheduler import BatchPolicy
from app.settings import Settings

log = logging.getLogger(__name__)

RunnerLoader = Callable[[ModelSpec, torch.device, int], ModelRunner]


def load_runner(spec: ModelSpec, device: torch.device, largest_length_bucket: int) -> ModelRunner:
    """The production loader (dispatcher threads only: it blocks for seconds)."""
    directory = local_directory(spec.source)
    return EmbeddingRunner(
        name=spec.name,
        source=str(directory),
        device=device,
        dtype=resolve_dtype(spec.dtype, device, directory),
        max_input_tokens=spec.max_input_tokens,
        largest_length_bucket=largest_length_bucket,
    )


def export_cuda_alloc_conf(settings: Settings) -> str:
    """Give PYTORCH_CUDA_ALLOC_CONF its default unless the environment sets it; returns the
    value in effect. Call before CUDA initialises (it reads the variable once, then)."""
    return os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", settings.cuda_alloc_conf)


def init_cuda(device: torch.device, alloc_conf: str | None) -> None:
    """Create the CUDA context now, not on the first request (compute thread)."""
    torch.cuda.init()  # type: ignore[no-untyped-call]
    torch.cuda.set_device(device)
    log.info(
        "CUDA initialised eagerly on %s (%s), PYTORCH_CUDA_ALLOC_CONF=%s",
        device,
        torch.cuda.get_device_name(device),
        alloc_conf,
    )


def policy_for(settings: Settings, max_input_tokens: int) -> BatchPolicy:
    """Length buckets up to the first one that holds the model's longest input, that one
    cut to it: shapes the model can never see are neither preallocated nor warmed up, and
    no batch is padded past the model's positions (with buckets (384, 768), a BERT of 512
    positions got its 385-512-token inputs padded to 768, and failed on them)."""
    buckets = settings.length_buckets
    needed = [b for b in buckets if b < max_input_tokens]
    holding = [min(b, max_input_tokens) for b in buckets if b >= max_input_tokens][:1]
    return BatchPolicy(
        length_buckets=tuple(needed + holding),
        max_batch_size=settings.max_batch_size,
        max_batch_tokens=settings.max_batch_tokens,
        max_wait_s=settings.max_wait_ms / 1000,
    )
