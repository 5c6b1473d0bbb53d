"""The engine's start-up loading: CUDA initialised eagerly, then each model's host made by
its task's factory (`tasks.py`), which loads the weights and preallocates its buffers
(docs/ARCHITECTURE.md §7).

Called from the engine's event loop thread; the blocking parts (CUDA, weights, pinned and
device memory) run on the dispatcher's compute threads.
"""

from __future__ import annotations

from dataclasses import replace

from app.engine.health import BatchHealth
from app.engine.host import EngineContext, ModelHost
from app.engine.tasks import HOST_FACTORIES
from app.startup import init_cuda


async def load_hosts(
    context: EngineContext, cuda_alloc_conf: str | None, health: BatchHealth
) -> dict[str, ModelHost]:
    """Every configured model's host, by name, each given a context whose `record_batch`
    counts its batches under its own name in `health`."""
    if context.device.type == "cuda":
        await context.dispatcher.run_compute(init_cuda, context.device, cuda_alloc_conf)
    hosts: dict[str, ModelHost] = {}
    for spec in context.settings.models:
        own = replace(context, record_batch=health.recorder(spec.name))
        hosts[spec.name] = await HOST_FACTORIES[spec.task](spec, own)
    return hosts
