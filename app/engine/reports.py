"""The engine's `/debug/config` report, as a JSON-ready dict (each host makes its own part
of `/debug/pool`). Engine event loop thread only."""

from __future__ import annotations

import torch

from app.dispatcher import ThreadPlan


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
