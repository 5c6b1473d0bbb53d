"""The engine's debug reports (`/debug/pool`, `/debug/config`), as JSON-ready dicts.
Engine event loop thread only."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from app.batcher import ModelBatcher
from app.dispatcher import ThreadPlan


def pool_report(batchers: Mapping[str, ModelBatcher]) -> dict[str, object]:
    """Per model: bytes preallocated, misses, waits, and each shape's slots, slots in use
    and estimated compute."""
    report: dict[str, object] = {}
    for name, batcher in batchers.items():
        stats = batcher.pool.stats()
        report[name] = {
            "bytes_preallocated": stats.bytes_preallocated,
            "misses": stats.misses,
            "acquire_waits": stats.acquire_waits,
            "shapes": [
                {
                    "batch": shape.batch,
                    "length": shape.length,
                    "slots": total,
                    "in_use": stats.in_use[shape],
                    "estimated_compute_ms": round(
                        batcher.scheduler.estimated_compute(shape) * 1000, 3
                    ),
                }
                for shape, total in stats.slots.items()
            ],
        }
    return report


def config_report(device: torch.device, plan: ThreadPlan) -> dict[str, object]:
    """The device and thread layout the engine runs with."""
    return {
        "device": str(device),
        "threads": {
            "compute": plan.compute_threads,
            "torch_intra_op": plan.torch_intra_op,
            "torch_inter_op": plan.torch_inter_op,
        },
    }
