"""The embedding runner's tokenizer with the real MiniLM tokenizer."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from app.models.base import InputTooLong
from app.models.embedding import EmbeddingRunner
from app.settings import BUNDLED_DEFAULT_SOURCE

LONG_TEXT = " ".join(["tail latency"] * 300)


def test_tokenizing_is_safe_across_threads_with_mixed_truncation() -> None:
    """Truncating and non-truncating calls at once (event loop and tokenizer threads) must
    not change each other's results."""
    runner = EmbeddingRunner(
        "m", BUNDLED_DEFAULT_SOURCE, torch.device("cpu"), torch.float32, None, 512
    )
    limit = runner.max_input_tokens

    def truncating() -> set[int]:
        return {len(runner.tokenize([LONG_TEXT], truncate=True)[0]) for _ in range(200)}

    def refusing() -> set[str]:
        outcomes = set()
        for _ in range(200):
            try:
                runner.tokenize([LONG_TEXT], truncate=False)
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
    runner = EmbeddingRunner(
        "m", BUNDLED_DEFAULT_SOURCE, torch.device("cpu"), torch.float32, None, 512
    )
    expected = runner.tokenizer(LONG_TEXT, truncation=True, max_length=runner.max_input_tokens)
    assert runner.tokenize([LONG_TEXT], truncate=True)[0] == expected["input_ids"]
    assert runner.tokenize(["short"], truncate=True) == runner.tokenize(["short"], truncate=False)
