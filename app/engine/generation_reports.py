"""What one generate model tells of itself: its gauges (KV-cache use, running and waiting
sequences) and its debug report (the cache's size and use, the step time admission predicts
with). Pure reads of the host's state; event loop thread only."""

from __future__ import annotations

from app.engine.generation_batch import SequenceTable
from app.metrics import Metrics
from app.models.causal_lm import CausalLMRunner


def refresh_gauges(metrics: Metrics, name: str, batch: SequenceTable) -> None:
    metrics.kv_cache_usage.labels(name).set(batch.slots.held / batch.slots.capacity)
    metrics.sequences.labels(name, "running").set(len(batch.running))
    metrics.sequences.labels(name, "waiting").set(len(batch.waiting))


def debug_report(runner: CausalLMRunner, batch: SequenceTable, step_s: float) -> dict[str, object]:
    """The cache's size and use, and the step time admission predicts with."""
    shape = runner.cache.shape
    return {
        "task": "generate",
        "kv_cache_bytes": runner.cache.bytes_allocated,
        "slots": shape.slots,
        "slot_tokens": shape.slot_tokens,
        "slots_held": batch.slots.held,
        "running": len(batch.running),
        "waiting": len(batch.waiting),
        "prefilling": sum(1 for sequence in batch.running.values() if sequence.prefilling),
        "step_ms": round(step_s * 1000, 3),
    }
