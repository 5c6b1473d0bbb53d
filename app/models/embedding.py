"""Sentence embeddings from any Hugging Face encoder, pooled as the model was trained to be
(`models.pooling`: mean, CLS or last token; mean when the model does not say).

Engine process only (it imports torch); the matching tokenizer is `models.tokenizer`.
"""

from __future__ import annotations

import logging

import torch
from transformers import AutoModel

from app.models.pooling import POOLERS, pooling_mode
from app.models.source import local_directory
from app.models.tokenizer import load_tokenizer

log = logging.getLogger(__name__)


class EmbeddingRunner:
    """`AutoModel`, pooled. Output vectors are *not* normalised here: whether to normalise
    is a per-request choice applied by the front end."""

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
        directory = local_directory(source)
        self.pooling = pooling_mode(directory)
        self._pool = POOLERS[self.pooling]
        log.info("loading %s from %s (%s, %s, %s)", name, directory, device, dtype, self.pooling)
        tokenizer = load_tokenizer(source, largest_length_bucket, max_input_tokens)
        self.max_input_tokens = tokenizer.max_input_tokens
        self.pad_token_id = tokenizer.pad_token_id
        model = AutoModel.from_pretrained(str(directory), dtype=dtype)
        self.model = model.to(device).eval()
        self.output_width = int(self.model.config.hidden_size)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Pooled vectors of one padded batch (compute threads only)."""
        with torch.inference_mode():
            hidden = self.model(
                input_ids=input_ids, attention_mask=attention_mask
            ).last_hidden_state
            return self._pool(hidden, attention_mask)
