"""The TorchServe handler behind `loadtest.bench`'s torchserve phase: the bundled
all-MiniLM-L6-v2 loaded and computed exactly as the raw phase does (`loadtest.minilm`,
Rust tokenizer, masked mean pooling, L2-normalised, the bench's dtype), so the phase measures
TorchServe's serving path, not a different computation.

TorchServe calls `handle(data, context)` in its Python worker with one batch: a list of
requests, each a dict whose "body" is the request body (decoded JSON for a JSON content type,
else bytes). A body is steadyserve's `/infer` body (`{"inputs": str | [str]}`); each request
gets steadyserve's `/infer` answer shape. Worker process only; TorchServe calls it from one
thread. The bench passes the dtype and torch threads in `STEADY_BENCH_DTYPE` and
`STEADY_BENCH_THREADS`, and the repository on `PYTHONPATH`.
"""

from __future__ import annotations

import json
import os
from typing import Any

from loadtest.minilm import MiniLM, configure_torch

MODEL_NAME = "all-MiniLM-L6-v2"

_model: MiniLM | None = None


def _loaded() -> MiniLM:
    global _model
    if _model is None:
        configure_torch(int(os.environ.get("STEADY_BENCH_THREADS", "1")))
        _model = MiniLM.load(os.environ.get("STEADY_BENCH_DTYPE", "bfloat16"))
        _model.embed_fast(["warm up the first call"])  # lazy kernels before serving
    return _model


def _texts(request: dict[str, Any]) -> list[str]:
    body = request.get("body") if request.get("body") is not None else request.get("data")
    if isinstance(body, (bytes, bytearray)):
        body = json.loads(body)
    inputs = body["inputs"]
    return [inputs] if isinstance(inputs, str) else list(inputs)


def handle(data: list[dict[str, Any]] | None, context: Any) -> list[dict[str, Any]] | None:
    """One answer per request of the batch, computed in one forward pass."""
    model = _loaded()
    if data is None:  # TorchServe's initialisation call
        return None
    per_request = [_texts(request) for request in data]
    vectors = model.embed_fast([text for texts in per_request for text in texts]).tolist()
    answers = []
    start = 0
    for texts in per_request:
        answers.append(
            {
                "model": MODEL_NAME,
                "outputs": vectors[start : start + len(texts)],
                "usage": {"inputs": len(texts)},
            }
        )
        start += len(texts)
    return answers
