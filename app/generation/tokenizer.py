"""A causal LM's tokenizer as a front end holds it: `FastTokenizer` (encode, decode) plus the
model's chat template. Torch-free and transformers-free."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from app.generation.chat import load_chat_template
from app.generation.errors import StopHoldsSpecialToken
from app.generation.token_texts import TokenTexts
from app.models.source import local_directory
from app.models.tokenizer import FastTokenizer, input_token_limit

# No length bucket applies to a prompt: its limit is the model's (and the engine's cache).
_UNBUCKETED = 1 << 30


class GenerationTokenizer(FastTokenizer):
    # Prompts as transformers 5 encodes them, by tokenizer.json alone: tokenizer_config.json's
    # add_eos_token would put an EOS after each prompt, which generation must never see.
    bos_eos_from_config = False

    def __init__(self, directory: Path, max_input_tokens: int) -> None:
        super().__init__(directory, max_input_tokens)
        # None: the model has none. No message may hold a special token's text.
        self.chat_template = load_chat_template(directory, self.special_tokens)
        self.token_texts = TokenTexts(self._backend)  # log probabilities' token names

    def stop_token_ids(self, stops: Sequence[str]) -> tuple[int, ...]:
        """The ids of the special tokens whose text is one of the stop strings: `decode`
        leaves special tokens out of the text, where such a stop string could never be
        found; the engine ends a sequence at these ids as at EOS. Raises
        `StopHoldsSpecialToken` for a stop string that holds a special token's text beside
        other text (`"<|im_end|>\\n"`), which could never be found either, nor ended at."""
        for stop in stops:
            if stop not in self.special_tokens:
                held = next((token for token in self.special_tokens if token in stop), None)
                if held is not None:
                    raise StopHoldsSpecialToken(stop, held)
        return tuple(
            dict.fromkeys(self.special_tokens[s] for s in stops if s in self.special_tokens)
        )


def load_generation_tokenizer(source: str, configured: int | None) -> GenerationTokenizer:
    """The tokenizer of a generate model; `max_input_tokens` is the most tokens a sequence
    (prompt and generated) may hold by the model's own files and the configured limit."""
    directory = local_directory(source)
    return GenerationTokenizer(directory, input_token_limit(directory, _UNBUCKETED, configured))
