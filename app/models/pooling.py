"""How token vectors become one sentence vector: the pooling a sentence-transformers model
was trained with (`modules.json` names its Pooling module, whose `config.json` says which),
mean pooling when the model says nothing.

Pure torch for the poolers (compute threads); `pooling_mode` reads files (engine start-up).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

Pooler = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors the mask keeps, accumulated in fp32."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1.0)


def cls_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """The first token's vector (BERT's [CLS]), in fp32."""
    return hidden[:, 0].to(torch.float32)


def last_token_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Each row's last real token's vector, in fp32 (rows are right-padded)."""
    last = (attention_mask.sum(dim=1) - 1).clamp(min=0)
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    return hidden[rows, last].to(torch.float32)


POOLERS: dict[str, Pooler] = {
    "pooling_mode_mean_tokens": mean_pool,
    "pooling_mode_cls_token": cls_pool,
    "pooling_mode_lasttoken": last_token_pool,
}


def _json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


# sentence-transformers modules a model may list and be served as trained: the encoder, its
# pooling (below), and normalisation (the `normalize` parameter, on by default). Any other
# (Dense, LayerNorm...) changes the vectors after pooling.
SERVED_MODULES = ("Transformer", "Pooling", "Normalize")


def pooling_mode(directory: Path) -> str:
    """The `pooling_mode_*` key the model's Pooling module turns on; mean pooling when the
    model has no such module. Raises `ValueError` for a pooling served nowhere here (max,
    weighted mean, several at once) or a module after it that is not applied here (a Dense
    projection: distiluse, LaBSE), rather than serve vectors the model was not trained to
    give."""
    modules = _json(directory / "modules.json") or []
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in SERVED_MODULES:
            raise ValueError(
                f"module {module.get('type')!r} is not served (only {', '.join(SERVED_MODULES)}): "
                "its vectors would not be the model's"
            )
    for module in modules:
        if str(module.get("type", "")).endswith("Pooling"):
            config = _json(directory / str(module.get("path", "")) / "config.json") or {}
            modes = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v)
            if len(modes) != 1 or modes[0] not in POOLERS:
                served = ", ".join(sorted(POOLERS))
                raise ValueError(f"pooling {modes or 'none'} is not served (only one of {served})")
            mode: str = modes[0]
            return mode
    return "pooling_mode_mean_tokens"
