"""The engine's start-up loading: CUDA initialised eagerly, every model loaded, and its
batch policy and preallocated buffer pool made (docs/ARCHITECTURE.md §7).

Called from the engine's event loop thread; the blocking parts (CUDA, weights, pinned and
device memory) run on the dispatcher's compute threads.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from app.buffers import BufferPool
from app.dispatcher import Dispatcher
from app.metrics import Metrics
from app.models.base import ModelRunner
from app.scheduler import BatchPolicy
from app.settings import Settings
from app.startup import RunnerLoader, init_cuda, policy_for

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    runner: ModelRunner
    policy: BatchPolicy
    pool: BufferPool


async def load_models(
    settings: Settings,
    dispatcher: Dispatcher,
    device: torch.device,
    loader: RunnerLoader,
    cuda_alloc_conf: str | None,
    metrics: Metrics,
) -> dict[str, LoadedModel]:
    """Every configured model, loaded, with its policy and buffer pool, by name."""
    if device.type == "cuda":
        await dispatcher.run_compute(init_cuda, device, cuda_alloc_conf)
    runners: dict[str, ModelRunner] = {}
    for spec in settings.models:
        runners[spec.name] = await dispatcher.run_compute(
            loader, spec, device, settings.length_buckets[-1]
        )
    loaded: dict[str, LoadedModel] = {}
    for name, runner in runners.items():
        policy = policy_for(settings, runner.max_input_tokens)
        # Preallocation touches the device (and pins host memory): a compute-thread job.
        pool = await dispatcher.run_compute(
            BufferPool,
            policy.shapes(),
            runner.output_width,
            runner.device,
            settings.pool_slots_per_shape or dispatcher.capacity,
        )
        metrics.pool_bytes.labels(name).set(pool.bytes_preallocated)
        log.info(
            "%s: buffer pool %d shapes, %.1f MiB",
            name,
            len(pool.stats().slots),
            pool.bytes_preallocated / 2**20,
        )
        loaded[name] = LoadedModel(runner, policy, pool)
    return loaded
