"""The usual first attempt at serving a model, kept as the bench's baseline.

The server a user writes first: one uvicorn worker whose ``async def /infer`` handler runs
the model on the request in hand, so requests are computed one at a time, in arrival order,
each with all of the process's torch threads (``--threads``); the rest wait on the event
loop. No batching, no admission control, no buffer reuse. Same request and response shapes
as steadyserve's ``/infer`` so the same generator drives both.

``python -m loadtest.naive_server --port 8100 [--threads 2] [--dtype bfloat16]``
"""

from __future__ import annotations

import argparse
import logging

from fastapi import FastAPI
from pydantic import BaseModel

from loadtest.minilm import DTYPES, MiniLM, configure_torch


class InferRequest(BaseModel):
    inputs: str | list[str]
    model: str | None = None
    timeout_ms: float | None = None


class InferResponse(BaseModel):
    model: str
    outputs: list[list[float]]
    usage: dict[str, int]


def create_naive_app(model: MiniLM) -> FastAPI:
    app = FastAPI(title="naive per-request server")

    @app.get("/readyz")
    def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/infer")
    async def infer(request: InferRequest) -> InferResponse:
        # Blocking on purpose: the naive baseline computes one request at a time.
        texts = [request.inputs] if isinstance(request.inputs, str) else request.inputs
        vectors = model.embed(texts)
        return InferResponse(
            model="all-MiniLM-L6-v2", outputs=vectors.tolist(), usage={"inputs": len(texts)}
        )

    return app


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="naive per-request FastAPI model server")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (all)")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    options = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    configure_torch(options.threads)
    model = MiniLM.load(options.dtype)
    model.embed(["warm up the first call"])  # load lazy kernels before serving

    import uvicorn

    uvicorn.run(
        create_naive_app(model),
        host=options.host,
        port=options.port,
        workers=1,
        log_level="warning",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
