"""The random decoder configuration and prompts the causal-LM runner's architecture tests
share (`test_causal_lm_architectures.py`, `test_direct_decoder.py`): small enough to build in
milliseconds, grouped-query (4 heads over 2), a large init range so greedy tokens vary."""

from __future__ import annotations

from typing import Any

SMALL_DECODER: dict[str, Any] = {
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.3,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
}
# Three lengths, prefilled together: rows right-padded to the longest.
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12], [1, 20, 21], [1, 30, 31, 32, 33, 34]]
