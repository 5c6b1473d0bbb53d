"""Text to token ids with the Rust `tokenizers` library alone: no torch, no transformers.

Front-end processes tokenize (the engine receives token ids), so this module must stay light:
a front end holds a tokenizer, never the model. The limits an input is checked against are
read from the model's JSON files, the same way for front end and engine.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer, processors

from app.models.source import local_directory

log = logging.getLogger(__name__)

# Tokenizers without a usable limit report a huge sentinel for model_max_length.
_NO_LIMIT = 1_000_000


class InputTooLong(Exception):
    """An input has more tokens than the model accepts and truncation is off."""

    def __init__(self, index: int, size: int, limit: int, unit: str = "tokens") -> None:
        self.index = index
        self.size = size
        self.limit = limit
        self.unit = unit
        super().__init__(self.described(f"input {index}"))

    def described(self, text: str) -> str:
        """The message, naming the text `text` (`the input`: one sent alone)."""
        return f"{text} has {self.size} {self.unit}; the limit is {self.limit}"


class TextTokenizer(Protocol):
    """What a front end needs of a model to turn texts into engine inputs. `tokenize` must be
    thread-safe (small requests are tokenized on the event loop, large ones on a thread)."""

    max_input_tokens: int
    pad_token_id: int

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids per text, special tokens included; raises `InputTooLong` unless
        `truncate`."""
        ...


def read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


# Encoders whose position ids start after the padding id (`create_position_ids_from_input_ids`
# in transformers): their first `pad_token_id + 1` positions are never an input's.
_POSITIONS_AFTER_PADDING = frozenset(
    {
        "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "data2vec-text", "ibert",
        "longformer", "mpnet", "roberta-prelayernorm", "markuplm", "luke",
    }
)  # fmt: skip


def input_token_limit(directory: Path, largest_length_bucket: int, configured: int | None) -> int:
    """The longest input the model takes: the smallest of the largest length bucket, the
    model's positions, the tokenizer's limit, the length a sentence-transformers model was
    trained for, and the configured `max_input_tokens`."""
    limits = [largest_length_bucket]
    config = read_json(directory / "config.json")
    positions = config.get("max_position_embeddings")
    if positions:
        # RoBERTa's family numbers positions from its padding id + 1: of its 514, 512 serve.
        offset = 0
        if config.get("model_type") in _POSITIONS_AFTER_PADDING:
            pad = config.get("pad_token_id")
            offset = (1 if pad is None else int(pad)) + 1
        limits.append(int(positions) - offset)
    tokenizer_limit = read_json(directory / "tokenizer_config.json").get("model_max_length")
    if tokenizer_limit and int(tokenizer_limit) < _NO_LIMIT:
        limits.append(int(tokenizer_limit))
    trained = read_json(directory / "sentence_bert_config.json").get("max_seq_length")
    if trained:
        limits.append(int(trained))
    if configured:
        limits.append(configured)
    return min(limits)


# The `tokenizer_class` values (less "Fast") whose transformers 4 fast tokenizer rebuilt its
# post-processor from tokenizer_config.json's add_bos_token/add_eos_token.
FLAG_HONOURING_CLASSES = frozenset(
    {
        "LlamaTokenizer", "CodeLlamaTokenizer", "GemmaTokenizer", "CohereTokenizer",
        "GPTNeoXTokenizer",
    }
)  # fmt: skip
# tokenizer_config.json's flags for the special tokens around a text, and the token each adds.
_SPECIAL_FLAGS = (("add_bos_token", "bos_token"), ("add_eos_token", "eos_token"))


def _token_text(value: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _specials_around(backend: Tokenizer) -> tuple[list[int], list[int]]:
    """The special tokens the post-processor puts before and after a text (probed on "a")."""
    text_only = backend.encode("a", add_special_tokens=False).ids
    full = backend.encode("a").ids
    for start in range(len(full) - len(text_only) + 1):
        if full[start : start + len(text_only)] == text_only:
            return list(full[:start]), list(full[start + len(text_only) :])
    return [], []


def honour_bos_eos_flags(backend: Tokenizer, config: dict[str, Any], name: str) -> None:
    """Where tokenizer_config.json sets `add_bos_token` or `add_eos_token` and tokenizer.json's
    post-processor disagrees (intfloat/e5-mistral-7b-instruct: `add_eos_token` true, a
    post-processor adding `<s>` alone), install the post-processor transformers 4's
    LlamaTokenizerFast built from the flags (`update_post_processor`, which transformers 5
    still runs when the flags are passed to `from_pretrained`): a last-token-pooling model
    pools the EOS it was trained on. A flag left out keeps what the post-processor does.
    Only for the tokenizer classes whose transformers 4 fast tokenizer honoured the flags
    (`FLAG_HONOURING_CLASSES`): any other class ignored them, and its models were trained on
    what its tokenizer.json adds."""
    tokenizer_class = str(config.get("tokenizer_class") or "").removesuffix("Fast")
    if tokenizer_class not in FLAG_HONOURING_CLASSES:
        return
    if not any(isinstance(config.get(flag), bool) for flag, _ in _SPECIAL_FLAGS):
        return
    leading, trailing = _specials_around(backend)
    adds: list[bool] = []
    wanted: list[tuple[str, int] | None] = []
    for (flag, key), around in zip(_SPECIAL_FLAGS, (leading[:1], trailing[-1:]), strict=True):
        token = _token_text(config.get(key))
        token_id = backend.token_to_id(token) if token is not None else None
        adds.append(token_id is not None and around == [token_id])
        flag_value = config.get(flag)
        want = flag_value if isinstance(flag_value, bool) else adds[-1]
        if want and token is not None and token_id is not None:
            wanted.append((token, token_id))
        else:
            wanted.append(None)  # transformers too adds no token it lacks
    if adds == [token is not None for token in wanted]:
        return
    bos, eos = wanted
    single = f"{bos[0] + ':0 ' if bos else ''}$A:0{' ' + eos[0] + ':0' if eos else ''}"
    pair = f"{single}{' ' + bos[0] + ':1' if bos else ''} $B:1{' ' + eos[0] + ':1' if eos else ''}"
    specials = [token for token in wanted if token is not None]
    backend.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=specials
    )
    log.warning(
        "%s: tokenizer_config.json's add_bos_token/add_eos_token disagree with tokenizer.json's "
        "post-processor; each text is encoded as %s (as transformers 4 encoded it)",
        name, single,
    )  # fmt: skip


class FastTokenizer:
    """A `tokenizer.json` (every fast Hugging Face tokenizer has one), padding and
    truncation off: inputs are padded by the engine and cut here."""

    # An embedding model pools what its texts were trained with: tokenizer_config.json's
    # add_bos_token and add_eos_token apply (`honour_bos_eos_flags`). A generate model's
    # prompts are encoded as transformers 5 encodes them, from tokenizer.json alone.
    bos_eos_from_config = True

    def __init__(self, directory: Path, max_input_tokens: int) -> None:
        path = directory / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: steadyserve needs a fast tokenizer (tokenizer.json)")
        self._backend = Tokenizer.from_file(str(path))
        self.directory = directory  # its files (/tokenizer_info reads tokenizer_config.json)
        # transformers' len(tokenizer): a token-id prompt's ids are below it.
        self.vocabulary_size = int(self._backend.get_vocab_size(with_added_tokens=True))
        # Fixed once: the Rust tokenizer keeps these on a shared object and releases the GIL
        # while encoding, so changing them per call would race between threads.
        self._backend.no_truncation()
        self._backend.no_padding()
        if self.bos_eos_from_config:
            config = read_json(directory / "tokenizer_config.json")
            honour_bos_eos_flags(self._backend, config, str(directory))
        self.max_input_tokens = max_input_tokens
        self.pad_token_id = self._pad_id(directory)
        # The special tokens appended after the text (BERT's [SEP]), kept when truncating.
        self._special_suffix = _specials_around(self._backend)[1]
        # The special added tokens (BOS, EOS, a chat template's turn markers) by their text:
        # `decode` leaves them out, and `encode` turns their text into them wherever it is
        # found (with or without `add_special_tokens`).
        self.special_tokens: dict[str, int] = {
            token.content: int(token_id)
            for token_id, token in self._backend.get_added_tokens_decoder().items()
            if token.special and token.content
        }
        self.special_token_ids = frozenset(self.special_tokens.values())

    def _pad_id(self, directory: Path) -> int:
        config = read_json(directory / "tokenizer_config.json")
        pad_token = config.get("pad_token")
        if isinstance(pad_token, dict):
            pad_token = pad_token.get("content")
        pad_id = self._backend.token_to_id(pad_token) if isinstance(pad_token, str) else None
        return int(pad_id) if pad_id is not None else 0

    def tokenize(self, texts: Sequence[str], truncate: bool) -> list[list[int]]:
        """Token ids per text; raises `InputTooLong` unless `truncate`, which cuts the text
        and keeps the closing special tokens. Thread-safe."""
        limit = self.max_input_tokens
        # One text (nearly every request) skips the batch call's thread-pool dispatch
        # (~10 us of ~40); the batch call without offsets, which nothing here reads.
        if len(texts) == 1:
            ids = [self._backend.encode(texts[0]).ids]
        else:
            ids = [encoding.ids for encoding in self._backend.encode_batch_fast(list(texts))]
        for index, sequence in enumerate(ids):
            if len(sequence) <= limit:
                continue
            if not truncate:
                raise InputTooLong(index, len(sequence), limit)
            suffix = self._special_suffix
            ids[index] = sequence[: limit - len(suffix)] + suffix
        return ids

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """One text's token ids, uncut (a prompt's limit is checked by its caller; a chat
        template writes its special tokens itself, so it encodes without adding them).
        Thread-safe."""
        return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of token ids, special tokens left out (generated text) unless
        `skip_special_tokens` is false (/detokenize, as transformers' `decode`). Thread-safe."""
        return str(self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_strs(self, token_ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry, as transformers' `convert_ids_to_tokens` gives it
        (`Ġthe`); ids below `vocabulary_size`."""
        return [self._backend.id_to_token(token_id) or "" for token_id in token_ids]


def load_tokenizer(
    source: str, largest_length_bucket: int, configured: int | None
) -> FastTokenizer:
    """A model's tokenizer, with the input limit the engine enforces too."""
    directory = local_directory(source)
    return FastTokenizer(directory, input_token_limit(directory, largest_length_bucket, configured))
