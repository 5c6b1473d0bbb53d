"""The bench's model: the raw phase's direct Rust-tokenizer path computes what the naive
server's usual tokenizer call computes (same vectors), so the phases differ in serving only."""

from __future__ import annotations

import numpy as np

from loadtest.bench import bench_sentences
from loadtest.minilm import MiniLM


def test_fast_tokenizer_path_gives_the_wrapper_path_vectors() -> None:
    model = MiniLM.load("float32")
    sentences = [*bench_sentences(6, 12, seed=3), "short", "a much longer sentence " * 10]
    wrapped = model.embed(sentences).numpy()
    fast = model.embed_fast(sentences).numpy()
    assert wrapped.shape == fast.shape == (len(sentences), 384)
    np.testing.assert_allclose(fast, wrapped, atol=1e-5)
