"""The front end's tokenizer (Rust `tokenizers` alone) with the real MiniLM files, checked
against transformers' own tokenizer, and kept free of torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from app.embedding_service import _tokenize
from app.model_specs import BUNDLED_DEFAULT_SOURCE
from app.models.source import resolve_source
from app.models.tokenizer import FastTokenizer, InputTooLong, load_tokenizer
from app.timing import PhaseTimer

LONG_TEXT = " ".join(["tail latency"] * 300)


def _tokenizer() -> FastTokenizer:
    return load_tokenizer(BUNDLED_DEFAULT_SOURCE, 512, None)


def test_limits_and_ids_match_transformers() -> None:
    ours = _tokenizer()
    reference = AutoTokenizer.from_pretrained(resolve_source(BUNDLED_DEFAULT_SOURCE))
    assert ours.max_input_tokens == 256  # sentence-transformers' max_seq_length
    assert ours.pad_token_id == reference.pad_token_id
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog", "p99 <= 150 ms"]
    assert ours.tokenize(texts, truncate=False) == reference(texts)["input_ids"]
    # One text takes its own call (no batch): the same ids.
    one_at_a_time = [ours.tokenize([text], truncate=False)[0] for text in texts]
    assert one_at_a_time == reference(texts)["input_ids"]


def test_tokenizing_is_safe_across_threads_with_mixed_truncation() -> None:
    """Truncating and non-truncating calls at once (event loop and tokenizer threads) must
    not change each other's results."""
    tokenizer = _tokenizer()
    limit = tokenizer.max_input_tokens

    def truncating() -> set[int]:
        return {len(tokenizer.tokenize([LONG_TEXT], truncate=True)[0]) for _ in range(200)}

    def refusing() -> set[str]:
        outcomes = set()
        for _ in range(200):
            try:
                tokenizer.tokenize([LONG_TEXT], truncate=False)
                outcomes.add("accepted")
            except InputTooLong:
                outcomes.add("refused")
        return outcomes

    with ThreadPoolExecutor(max_workers=4) as pool:
        truncated = [pool.submit(truncating) for _ in range(2)]
        refused = [pool.submit(refusing) for _ in range(2)]
        assert all(f.result() == {limit} for f in truncated)
        assert all(f.result() == {"refused"} for f in refused)


def test_truncation_keeps_the_closing_special_token() -> None:
    tokenizer = _tokenizer()
    reference = AutoTokenizer.from_pretrained(resolve_source(BUNDLED_DEFAULT_SOURCE))
    expected = reference(LONG_TEXT, truncation=True, max_length=tokenizer.max_input_tokens)
    assert tokenizer.tokenize([LONG_TEXT], truncate=True)[0] == expected["input_ids"]
    assert tokenizer.tokenize(["short"], truncate=True) == tokenizer.tokenize(
        ["short"], truncate=False
    )


def test_a_front_end_app_never_imports_torch() -> None:
    """Front ends hold a tokenizer, not the model: building a process-mode app (as each
    front end does) and loading its models' tokenizers (as its start-up does) must not load
    torch or transformers."""
    probe = (
        "import sys\n"
        "from app.main import create_app\n"
        "from app.engine.zmq_client import EngineAddresses\n"
        "from app.tokenizer_pool import load_model_tokenizer\n"
        "from app.settings import Settings\n"
        "settings = Settings()\n"
        "create_app(settings, engine_addresses=EngineAddresses('ipc:///x', 'ipc:///y'))\n"
        "for spec in settings.models:\n"
        "    load_model_tokenizer(spec, settings.length_buckets[-1])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    assert result.stdout.strip() == "[]"


class _Inline:
    """A service's `run_tokenizer`, run at once."""

    async def run_tokenizer(
        self, chars: int, timer: PhaseTimer, work: Callable[..., object], *args: object
    ) -> object:
        return work(*args)


def _embedding_inputs(tokenizer: FastTokenizer, texts: list[str]) -> object:
    """The token ids the embedding pipeline sends for `texts` with `truncate`."""
    return asyncio.run(_tokenize(_Inline(), tokenizer, texts, True, PhaseTimer()))  # type: ignore[arg-type]


def test_truncating_a_long_text_keeps_the_first_tokens_transformers_keeps() -> None:
    """MiniLM's cap is 256 x 32 = 8,192 characters: the pipeline cut a text there before
    tokenizing, so 20,000 spaces then "hello" (3 tokens) was embedded as [CLS] [SEP], and a
    text cut within a word ended in that word's first pieces."""
    tokenizer = _tokenizer()
    reference = AutoTokenizer.from_pretrained(resolve_source(BUNDLED_DEFAULT_SOURCE))
    limit = tokenizer.max_input_tokens
    texts = [
        " " * 20_000 + "hello",
        "\n" * 9_000 + LONG_TEXT,
        " " * 8_185 + "unbelievably " * 40,  # the cut fell within a word
        LONG_TEXT * 10,  # dense: the first 8,192 characters hold the tokens kept
        "x" * 300 + " " + LONG_TEXT,  # a word over 100 characters: one [UNK]
    ]
    expected = reference(texts, truncation=True, max_length=limit)["input_ids"]
    assert _embedding_inputs(tokenizer, texts) == expected
    assert expected[0] == reference("hello")["input_ids"]
