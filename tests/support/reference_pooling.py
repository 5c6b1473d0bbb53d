"""The reference computation's pooling, written here rather than imported from the code
under test: a mistake in `app.models.pooling` must not be shared by the server and the
reference it is compared with (`tests/unit/test_pooling.py` pins the app's own on
hand-computed values)."""

from __future__ import annotations

import torch


def masked_mean(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's mean over the tokens its mask keeps (sentence-transformers' mean pooling),
    in float64."""
    weights = attention_mask.to(torch.float64)[..., None]
    return (hidden.to(torch.float64) * weights).sum(dim=1) / weights.sum(dim=1)
