"""An engine that "generates" by echoing each prompt's own tokens back, for front-end tests
whose point is the protocol (stop strings and disconnects cancel the engine request,
interleaved sequences, failures mid-stream), not the model.

Each embedding request is answered at once with zero vectors (an embedding model's width).
Each generate request gets its prompt's ids (the first, BOS, left out) cycled up to its
`max_new_tokens` (or fewer, ending in EOS, with `eos_after_tokens`), one token per output,
with made-up log probabilities when asked (`scripted_logprobs`: they name their token),
each output after one event-loop turn (or `outputs_per_turn` of them at once, as a reader
that fell behind the engine finds them); the final output says why it ended. Cancelled
request ids are recorded. Event loop thread only.
"""

from __future__ import annotations

import asyncio

import numpy as np

from app.engine.protocol import (
    Cancel,
    EmbedOutput,
    EmbedPayload,
    Failure,
    FailureKind,
    FinishReason,
    GeneratePayload,
    ModelInfo,
    Output,
    Submit,
    ToEngine,
    TokensOutput,
)
from app.engine.protocol_logprobs import TokenLogprobs
from app.model_specs import ModelSpec
from app.settings import Settings
from loadtest.null_engine import AlwaysReadyEngine

EMBEDDING_WIDTH = 384


def scripted_logprobs(token_id: int, top: int) -> TokenLogprobs:
    """A token's made-up log probability, -id/1000 (it names the token), and `top`
    alternatives: itself and the ids after it."""
    ids = [token_id + i for i in range(top)]
    return TokenLogprobs(-token_id / 1000, ids, [-i / 1000 for i in ids])


class ScriptedGenerator(AlwaysReadyEngine):
    engine_id = "scripted"

    def __init__(self, settings: Settings, max_sequence_tokens: int = 256) -> None:
        super().__init__(settings)
        self._max_sequence_tokens = max_sequence_tokens
        self._running: dict[int, asyncio.Task[None]] = {}
        self.submitted: list[Submit] = []
        self.cancelled: list[int] = []
        self.fail_after_tokens: int | None = None  # set: requests fail after this many
        self.eos_after_tokens: int | None = None  # set: sequences end (EOS) after this many
        self.outputs_per_turn = 1  # outputs delivered together before the reader runs
        self.compute_s_per_output = 0.0  # the compute each output reports
        self.tokens_per_output = 1  # tokens each output carries (a run's handed over at once)

    def model_info(self, spec: ModelSpec) -> ModelInfo:
        # As the real engine reports them: an embedding's width, a generate model's vocabulary.
        width = EMBEDDING_WIDTH if spec.task == "embed" else 500
        return ModelInfo(spec.task, width, self._max_sequence_tokens - 1)

    async def close(self) -> None:
        for task in self._running.values():
            task.cancel()

    @property
    def running(self) -> int:
        return len(self._running)

    def _send(self, message: ToEngine) -> None:
        if isinstance(message, Cancel):
            self.cancelled.append(message.request_id)
            task = self._running.pop(message.request_id, None)
            if task is not None:
                task.cancel()
            return
        if isinstance(message, Submit) and isinstance(message.payload, EmbedPayload):
            ids = message.payload.token_ids
            vectors = np.zeros((len(ids), EMBEDDING_WIDTH), dtype=np.float32).tobytes()
            answer = EmbedOutput(vectors, len(ids), EMBEDDING_WIDTH, sum(map(len, ids)))
            self._deliver(Output(message.request_id, True, answer, queue_s=0.0, compute_s=0.0))
        if isinstance(message, Submit) and isinstance(message.payload, GeneratePayload):
            self.submitted.append(message)
            task = asyncio.get_running_loop().create_task(self._generate(message))
            self._running[message.request_id] = task

    async def _generate(self, request: Submit) -> None:
        payload = request.payload
        assert isinstance(payload, GeneratePayload)
        echo = payload.prompt_ids[1:] or payload.prompt_ids
        count = payload.sampling.max_new_tokens
        reason = FinishReason.LENGTH
        if self.eos_after_tokens is not None and self.eos_after_tokens < count:
            count, reason = self.eos_after_tokens, FinishReason.EOS
        try:
            per_output = self.tokens_per_output
            for number, step in enumerate(range(0, count, per_output)):
                if number % self.outputs_per_turn == 0:
                    await asyncio.sleep(0)
                if self.fail_after_tokens is not None and step >= self.fail_after_tokens:
                    self._deliver(Failure(request.request_id, FailureKind.FAILED, "boom"))
                    return
                final = step + per_output >= count
                ids = [echo[i % len(echo)] for i in range(step, min(step + per_output, count))]
                asked = payload.sampling.logprobs
                tokens = TokensOutput(
                    ids,
                    len(payload.prompt_ids),
                    reason if final else None,
                    None if asked is None else [scripted_logprobs(i, asked) for i in ids],
                )
                compute_s = self.compute_s_per_output
                self._deliver(Output(request.request_id, final, tokens, 0.0, compute_s))
        finally:
            self._running.pop(request.request_id, None)
