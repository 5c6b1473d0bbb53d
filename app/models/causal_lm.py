"""Any Hugging Face causal LM, run step by step over the preallocated slot cache.

`CausalLMRunner.step` computes one forward for a set of rows, each in its own cache slot at
its own positions: a prompt or a chunk of one (prefill) or the last chosen token (decode).
Rows of different lengths are right-padded; the padding's keys and values go to the cache's
sink, never into a slot (`kv_cache.py`), so nothing a row reads depends on its padding.
Engine process only; `step` runs on compute threads, one at a time per runner (the cache is
the runner's).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from app.engine.protocol import SamplingParams
from app.model_specs import ModelSpec
from app.models.base import resolve_dtype
from app.models.causal_lm_config import (
    logits_scaling_divides,
    refuse_unsupported_attention,
    token_ids,
    uniform_rope_positions,
)
from app.models.direct_decoder import DirectDecoder
from app.models.kv_cache import CacheShape, SlotKVCache
from app.models.logprobs import LogprobSink, record_logprobs, record_prompt_logprobs
from app.models.sampling import NO_TOKEN, NOT_CHOSEN, choose_tokens
from app.models.source import local_directory
from app.models.token_buckets import bucket_prefills, padded_tokens

log = logging.getLogger(__name__)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True, slots=True)
class StepRow:
    """One sequence's part of a step: its slot, the tokens fed now (its prompt or a chunk of
    it, or the last chosen token), the cache position of the first, and how its next token
    is chosen; with `sampling.logprobs` set, where the chosen token's log probabilities go
    (its sequence's, by position: `logprobs.record_logprobs`). `prefill`: its tokens are
    its prompt's (from `start`), so it runs with the other prompt rows, not the decode rows,
    and records their log probabilities when `sampling.prompt_logprobs` asks. A chunk that
    is not its prompt's last (chunked prefill) names the prompt's token after it
    (`next_prompt_token`): such a row chooses no token (`step` gives it `NOT_CHOSEN`: no
    generator draw, no log probabilities of a chosen token), and its last position's prompt
    log probability is that token's."""

    slot: int
    token_ids: Sequence[int]
    start: int
    sampling: SamplingParams
    generator: torch.Generator
    logprobs: LogprobSink | None = None
    prefill: bool = False
    next_prompt_token: int | None = None

    @property
    def chooses(self) -> bool:
        """It wants a token from this step (all rows but a prompt's non-final chunk)."""
        return self.next_prompt_token is None


class CausalLMRunner:
    """`AutoModelForCausalLM` with its slot cache (`kv_cache.py`), allocated at load."""

    task = "generate"

    def __init__(
        self,
        name: str,
        source: str,
        device: torch.device,
        dtype: torch.dtype,
        slots: int,
        slot_tokens: int,
        direct: bool = True,
    ) -> None:
        """`direct`: run the decoder's forward written out (`direct_decoder.py`) where it
        reproduces the model; False always runs the model's own."""
        self.name = name
        self.device = device
        self.dtype = dtype
        directory = local_directory(source)
        log.info("loading %s from %s (%s, %s)", name, directory, device, dtype)
        model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype)
        self.model = model.to(device).eval()  # type: ignore[arg-type]
        config = self.model.config.get_text_config()
        generation = self.model.generation_config
        # EOS as model.generate sees it: the generation config's, else the model config's.
        self.eos_token_ids = token_ids(generation.eos_token_id) or token_ids(
            getattr(config, "eos_token_id", None)
        )
        self.vocab_size = int(config.vocab_size)
        pad = generation.pad_token_id
        if pad is None:
            pad = getattr(config, "pad_token_id", None)
        # Padding's value is never attended to, but it is embedded: any id in the vocabulary
        # serves, one outside it (-1 in old LLaMA conversions) fails every padded step.
        in_vocabulary = [t for t in self.eos_token_ids if 0 <= t < self.vocab_size]
        self.pad_token_id = (
            int(pad)
            if isinstance(pad, int) and 0 <= pad < self.vocab_size
            else min(in_vocabulary, default=0)
        )
        positions = int(getattr(config, "max_position_embeddings", slot_tokens) or slot_tokens)
        self.max_sequence_tokens = min(slot_tokens, positions, uniform_rope_positions(config))
        refuse_unsupported_attention(name, config)
        layers = int(config.num_hidden_layers)
        self._window: int | None = getattr(config, "sliding_window", None)
        # Without per-layer types, a configured window applies to every layer (Mistral).
        default_type = SLIDING_ATTENTION if self._window else FULL_ATTENTION
        self._layer_types = set(getattr(config, "layer_types", None) or [default_type])
        unsupported = self._layer_types - {FULL_ATTENTION, SLIDING_ATTENTION}
        if unsupported:
            raise ValueError(f"{name}: attention layer types {sorted(unsupported)} unsupported")
        heads = int(config.num_attention_heads)
        head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // heads
        shape = CacheShape(
            layers=layers,
            slots=slots,
            slot_tokens=self.max_sequence_tokens,
            kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
        )
        self.cache = SlotKVCache(shape, dtype, device)
        layer_kinds = getattr(config, "layer_types", None) or [default_type] * layers
        self._direct = DirectDecoder.build(self.model, layer_kinds) if direct else None
        if self._direct is not None and device.type == "cuda":
            # The unfused weights' blocks, cached by the allocator, cannot hold the larger
            # fused ones: hand them back rather than hold both copies' memory.
            torch.cuda.empty_cache()
        # Reused every step: key positions for masks and prompt positions, and the mask's
        # two values (0 where a query may attend, the dtype's lowest where it may not).
        self._key_positions = torch.arange(self.max_sequence_tokens, device=device)
        self._mask_open = torch.zeros((), dtype=dtype, device=device)
        self._mask_blocked = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=device)
        self._base = self.model.base_model
        # transformers renamed the forward's cache argument from `past_key_values` to `cache`
        # within 5.x (5.17 has the old name): one the forward does not name would be taken
        # into its **kwargs and ignored, and each step would attend to its own tokens only.
        forward_parameters = inspect.signature(self._base.forward).parameters
        self._cache_argument = "cache" if "cache" in forward_parameters else "past_key_values"
        self._head = self.model.get_output_embeddings()
        # What some models' own forward does to the head's output, which `logits` (base
        # model + head, without that forward) must do too: Cohere multiplies by its
        # `logit_scale`, Granite divides by its `logits_scaling` and HyperCLOVA X multiplies
        # by its own, Gemma 2 and 3 soft-cap.
        self._logit_scale = float(getattr(config, "logit_scale", None) or 1.0)
        self._logits_scaling, self._scaling_divides = logits_scaling_divides(name, config)
        self._softcap = getattr(config, "final_logit_softcapping", None)
        log.info(
            "%s: KV cache %d slots x %d tokens, %.1f MiB",
            name,
            slots,
            shape.slot_tokens,
            self.cache.bytes_allocated / 2**20,
        )

    def linear_tokens(self, tokens: int) -> int:
        """The row count a step of `tokens` (rows x query) runs its linears on: bucketed over
        the slot count by the direct decoder on a CPU (`token_buckets.py`), else itself."""
        if self._direct is None or not self._direct.pads_tokens:
            return tokens
        return padded_tokens(tokens, self.cache.shape.slots)

    def prefill_buckets(
        self, row_tokens: int, step_tokens: int, warmed: Collection[int]
    ) -> list[tuple[int, int]]:
        """A prefill (rows, tokens a row) for each bucket `linear_tokens` gives a prefill step
        of at most `row_tokens` a row and `step_tokens` in all (rows x longest) but those in
        `warmed`: none where nothing is padded (CUDA; the model's own forward, whose prefill
        shapes are the steps' own, any number)."""
        if self._direct is None or not self._direct.pads_tokens:
            return []
        slots = self.cache.shape.slots
        shapes = bucket_prefills(slots, slots, row_tokens, step_tokens)
        return [
            shape for shape in shapes if padded_tokens(shape[0] * shape[1], slots) not in warmed
        ]

    def _masks(self, positions: torch.Tensor, kv_length: int) -> dict[str, torch.Tensor]:
        """Additive masks (rows, 1, query, keys): a query sees its row's keys up to its own
        position (within the window, for sliding layers)."""
        keys = self._key_positions[:kv_length]
        distance = positions.unsqueeze(-1) - keys  # (rows, query, keys)
        allowed = distance >= 0
        masks: dict[str, torch.Tensor] = {}
        for layer_type in self._layer_types:
            layer_allowed = allowed
            if layer_type == SLIDING_ATTENTION and self._window is not None:
                layer_allowed = allowed & (distance < self._window)
            # One op from the two cached 0-d values, instead of zeros + masked_fill.
            mask = torch.where(layer_allowed, self._mask_open, self._mask_blocked)
            masks[layer_type] = mask.unsqueeze(1)
        return masks

    @staticmethod
    def _transformers_mask(
        masks: dict[str, torch.Tensor],
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """One 4-D mask, which every model takes as prepared; a mask per layer type only
        for models with sliding-window layers (those take a {layer type: mask} mapping)."""
        if len(masks) == 1:
            return next(iter(masks.values()))
        return masks

    def _plan(self, rows: Sequence[StepRow]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The step's input ids and positions (rows, query) and its key length, and the
        cache's plan for it. Every per-row number comes from one Python list made into one
        tensor (one copy to the device): per-row or per-field tensors cost more than the
        forward of a small model."""
        lengths = [len(row.token_ids) for row in rows]
        query = max(lengths)
        limit = self.max_sequence_tokens - 1
        pad = self.pad_token_id
        longest_start = max(row.start for row in rows)
        # Columns: the tokens right-padded to `query`, then start, slot and length.
        table = torch.tensor(
            [
                [*row.token_ids, *[pad] * (query - length), row.start, row.slot, length]
                for row, length in zip(rows, lengths, strict=True)
            ],
            dtype=torch.int64,
        ).to(self.device)
        input_ids = table[:, :query]
        positions = table[:, query : query + 1]  # (rows, 1): a decode step's positions
        if query > 1:
            positions = positions + self._key_positions[:query]
        if longest_start + query - 1 > limit:
            positions = positions.clamp(max=limit)  # padding past the cache's end
        kv_length = min(longest_start + query - 1, limit) + 1
        slots = [row.slot for row in rows]
        consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
        row_slots = table[:, query + 1]
        # Padded rows: their padding writes to the cache's sink, not their slots.
        written = (
            self._key_positions[:query] < table[:, query + 2 :] if min(lengths) < query else None
        )
        self.cache.plan_step(
            row_slots, positions, kv_length, slots[0] if consecutive else None, written
        )
        return input_ids, positions, kv_length

    def logits(self, rows: Sequence[StepRow]) -> torch.Tensor:
        """float32 logits (rows, vocab) after each row's last fed token; writes the rows'
        keys and values into their slots, and the prompt's log probabilities of a prefill
        row that asks for them (`SamplingParams.prompt_logprobs`) into its sink. Compute
        threads only."""
        input_ids, positions, kv_length = self._plan(rows)
        query = input_ids.shape[1]
        with torch.inference_mode():
            masks = self._masks(positions, kv_length)
            if self._direct is not None:
                hidden = self._direct(input_ids, positions, masks, self.cache)
            else:
                hidden = self._base(
                    input_ids=input_ids,
                    attention_mask=self._transformers_mask(masks),
                    position_ids=positions,
                    use_cache=True,
                    **{self._cache_argument: self.cache},
                ).last_hidden_state
            if all(len(row.token_ids) == query for row in rows):
                # Every row's last token is the last column. Copied out of the strided view:
                # on a CPU, oneDNN builds a matrix product per input layout too, and the
                # head's input must be the decode steps' (rows, width), whose sizes warm-up
                # ran, not a new row stride per prompt length.
                picked = hidden[:, -1]
                if query > 1:  # (`contiguous` keeps a single row's stride)
                    picked = picked.clone(memory_format=torch.contiguous_format)
            else:
                last = torch.tensor([len(row.token_ids) - 1 for row in rows], device=self.device)
                picked = hidden[torch.arange(len(rows), device=self.device), last]
            for index, row in enumerate(rows):
                top = row.sampling.prompt_logprobs
                if row.prefill and top is not None and row.logprobs is not None:
                    # Positions start+1.. of the chunk; a non-final chunk's last position
                    # predicts the next chunk's first token.
                    fed = list(row.token_ids)
                    if row.next_prompt_token is not None:
                        fed.append(row.next_prompt_token)
                    own = hidden[index, : len(fed) - 1]
                    record_prompt_logprobs(
                        own,
                        fed,
                        top,
                        row.logprobs,
                        self._head_logits,
                        self.vocab_size,
                        first=row.start,
                    )
            return self._head_logits(picked)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states (..., width): the head, then what the model's own
        forward does to its output (`__init__`). Inside `inference_mode`."""
        logits: torch.Tensor = self._head(hidden)
        if self._logit_scale != 1.0:
            logits = logits * self._logit_scale
        if self._logits_scaling != 1.0:
            if self._scaling_divides:
                logits = logits / self._logits_scaling
            else:
                logits = logits * self._logits_scaling
        if self._softcap:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()

    def step(self, rows: Sequence[StepRow]) -> list[int]:
        """Each row's next token, or `NO_TOKEN` for a row whose logits are not finite, or
        `NOT_CHOSEN` for a row that chooses none (a non-final prefill chunk: no draw from its
        generator; `NO_TOKEN` too when its logits are not finite, for its slot now holds
        what broke them), and the log probabilities of those whose rows asked (compute
        threads only, one step at a time)."""
        logits = self.logits(rows)
        chosen = [NOT_CHOSEN] * len(rows)
        resting = [index for index, row in enumerate(rows) if not row.chooses]
        if resting:
            # As `choose_tokens` judges a row: its maximum (NaN propagates) must be finite.
            rested = logits[torch.tensor(resting, device=logits.device)].max(dim=-1).values
            for index, finite in zip(resting, torch.isfinite(rested).tolist(), strict=True):
                chosen[index] = NOT_CHOSEN if finite else NO_TOKEN
        choosing = [index for index, row in enumerate(rows) if row.chooses]
        if not choosing:
            return chosen
        if len(choosing) < len(rows):
            logits = logits[torch.tensor(choosing, device=logits.device)]
        picked = [rows[index] for index in choosing]
        tokens = choose_tokens(
            logits, [row.sampling for row in picked], [row.generator for row in picked]
        )
        record_logprobs(logits, picked, tokens)
        for index, token in zip(choosing, tokens, strict=True):
            chosen[index] = token
        return chosen


def load_causal_lm(
    spec: ModelSpec, device: torch.device, slots: int, slot_tokens: int
) -> CausalLMRunner:
    """The causal LM in the dtype its spec and checkpoint call for, with its KV cache
    (compute thread: it reads or downloads the files and touches the device)."""
    directory = local_directory(spec.source)
    dtype = resolve_dtype(spec.dtype, device, directory)
    direct = spec.forward == "auto"
    return CausalLMRunner(spec.name, str(directory), device, dtype, slots, slot_tokens, direct)
