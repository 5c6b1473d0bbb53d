"""Sentence embeddings from any Hugging Face encoder: attention-masked mean pooling."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import AutoModel, AutoTokenizer

from app.models.base import InputTooLong, resolve_source

log = logging.getLogger(__name__)

# Tokenizers without a usable limit report a huge sentinel for model_max_length.
_NO_LIMIT = 1_000_000


def _sentence_transformers_max_length(directory: str) -> int | None:
    """sentence-transformers records the length a model was trained for; honour it."""
    config = Path(directory) / "sentence_bert_config.json"
    if not config.is_file():
        return None
    value = json.loads(config.read_text()).get("max_seq_length")
    return int(value) if value else None


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Mean of the token vectors the mask keeps, accumulated in fp32."""
    mask = attention_mask.unsqueeze(-1).to(torch.float32)
    summed = (hidden.to(torch.float32) * mask).sum(dim=1)
    return summed / mask.sum(dim=1).clamp(min=1.0)


class EmbeddingRunner:
    """Tokenizer + `AutoModel`, pooled. Output vectors are *not* normalised here: whether to
    normalise is a per-request choice applied when the batch is copied out."""

    task = "embed"

    def __init__(
        self,
        name: str,
        source: str,
        device: torch.device,
        dtype: torch.dtype,
        max_input_tokens: int | None,
        largest_length_bucket: int,
    ) -> None:
        self.name = name
        self.device = device
        self.dtype = dtype
        location = resolve_source(source)
        log.info("loading %s from %s (%s, %s)", name, location, device, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(location)
        self._backend = (
            getattr(self.tokenizer, "_tokenizer", None) if self.tokenizer.is_fast else None
        )
        if self._backend is not None:
            self._backend.no_truncation()
            self._backend.no_padding()
        model = AutoModel.from_pretrained(location, dtype=dtype)
        self.model = model.to(device).eval()
        limits = [largest_length_bucket, int(self.model.config.max_position_embeddings)]
        tokenizer_limit = int(getattr(self.tokenizer, "model_max_length", _NO_LIMIT))
        if tokenizer_limit < _NO_LIMIT:
            limits.append(tokenizer_limit)
        trained_limit = _sentence_transformers_max_length(location)
        if trained_limit:
            limits.append(trained_limit)
        if max_input_tokens:
            limits.append(max_input_tokens)
        self.max_input_tokens = min(limits)
        self.output_width = int(self.model.config.hidden_size)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else 0
        self._special_suffix = self._trailing_special_tokens()

    def _encode(self, texts: list[str]) -> list[list[int]]:
        # Always the same settings: a fast tokenizer stores truncation on its shared Rust
        # object and releases the GIL while encoding, so varying it per call would let
        # concurrent callers (event loop and tokenizer threads) change each other's. Truncation
        # happens in `tokenize`. The Rust tokenizer is called directly where there is one:
        # the Python wrapper costs more than the encoding of a short sentence.
        if self._backend is not None:
            return [encoding.ids for encoding in self._backend.encode_batch(texts)]
        ids: list[list[int]] = self.tokenizer(
            texts,
            add_special_tokens=True,
            truncation=False,
            return_attention_mask=False,
            return_token_type_ids=False,
        )["input_ids"]
        return ids

    def _trailing_special_tokens(self) -> list[int]:
        """The special tokens the tokenizer appends after the text (BERT's [SEP])."""
        text_only: list[int] = self.tokenizer("a", add_special_tokens=False)["input_ids"]
        full = self._encode(["a"])[0]
        for start in range(len(full) - len(text_only) + 1):
            if full[start : start + len(text_only)] == text_only:
                return full[start + len(text_only) :]
        return []

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids per text, special tokens included; raises `InputTooLong` unless
        `truncate`, which cuts the text (keeping the closing special tokens). Thread-safe:
        called on the event loop for small requests and on tokenizer threads otherwise."""
        limit = self.max_input_tokens
        ids = self._encode(list(texts))
        for index, sequence in enumerate(ids):
            if len(sequence) <= limit:
                continue
            if not truncate:
                raise InputTooLong(index, len(sequence), limit)
            suffix = self._special_suffix
            ids[index] = sequence[: limit - len(suffix)] + suffix
        return ids

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean-pooled vectors of one padded batch (compute threads only)."""
        with torch.inference_mode():
            hidden = self.model(
                input_ids=input_ids, attention_mask=attention_mask
            ).last_hidden_state
            return mean_pool(hidden, attention_mask)
