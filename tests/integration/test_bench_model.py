"""The bench's model: the raw phase's direct Rust-tokenizer path computes what the naive
server's usual tokenizer call computes (same vectors), so the phases differ in serving only."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from loadtest.bench_phases import bench_sentences
from loadtest.minilm import MiniLM


def test_fast_tokenizer_path_gives_the_wrapper_path_vectors() -> None:
    model = MiniLM.load("float32")
    sentences = [*bench_sentences(6, 12, seed=3), "short", "a much longer sentence " * 10]
    wrapped = model.embed(sentences).numpy()
    fast = model.embed_fast(sentences).numpy()
    assert wrapped.shape == fast.shape == (len(sentences), 384)
    np.testing.assert_allclose(fast, wrapped, atol=1e-5)


def test_torchserve_handler_answers_each_request_of_a_batch_with_its_vectors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TorchServe hands the handler one batch of requests (JSON bodies decoded, or bytes);
    each gets its own texts' vectors, computed as the raw phase computes them."""
    from loadtest import torchserve_handler

    monkeypatch.setenv("STEADY_BENCH_DTYPE", "float32")
    # The handler sets torch's threads for its process: keep this process's as they are.
    monkeypatch.setenv("STEADY_BENCH_THREADS", str(torch.get_num_threads()))
    monkeypatch.setattr(torchserve_handler, "_model", None)
    texts = bench_sentences(4, 12, seed=5)
    batch = [
        {"body": {"inputs": texts[0]}},
        {"body": json.dumps({"inputs": texts[1:3]}).encode()},
        {"data": bytearray(json.dumps({"inputs": [texts[3]]}).encode())},
    ]
    answers = torchserve_handler.handle(batch, context=None)
    assert answers is not None
    assert [len(answer["outputs"]) for answer in answers] == [1, 2, 1]
    assert [answer["usage"] for answer in answers] == [{"inputs": 1}, {"inputs": 2}, {"inputs": 1}]
    got = np.array([row for answer in answers for row in answer["outputs"]])
    expected = MiniLM.load("float32").embed_fast(texts).numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert torchserve_handler.handle(None, context=None) is None  # the initialisation call
