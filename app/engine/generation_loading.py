"""Loading a `generate` model: its causal LM and preallocated KV cache, then its host
(`generation_host.py`). Called once per generate model at the engine's start-up
(`tasks.py`), from the engine's event loop thread; the loading runs on a compute thread."""

from __future__ import annotations

from app.engine.generation_host import GenerationHost
from app.engine.host import EngineContext
from app.model_specs import ModelSpec
from app.models.causal_lm import load_causal_lm


async def load_generation_host(spec: ModelSpec, context: EngineContext) -> GenerationHost:
    """Load the causal LM and preallocate its KV cache (on a compute thread: it touches the
    device), sized from the settings alone."""
    slots, tokens = context.settings.generate_slots, context.settings.generate_slot_tokens
    runner = await context.dispatcher.run_compute(
        load_causal_lm, spec, context.device, slots, tokens
    )
    context.metrics.pool_bytes.labels(spec.name).set(runner.cache.bytes_allocated)
    return GenerationHost(runner, context)
