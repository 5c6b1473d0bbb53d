"""A line the server answers 500 `device_lost` (its batch failed with a sticky CUDA error and
the engine restarts: the line may be what caused it) is not resent unchanged: retried as any
500 (up to 9 tries, and a pack's lines then 9 tries each alone), one bad line took the
server's engine down up to 18 times, each a reload and warm-up. Scripted transport (`_post`),
no server."""

from __future__ import annotations

import orjson

from app.batchclient import BatchClient, ClientOptions, Failure, Item, RetryPolicy, Success
from app.batchclient.attempt import Attempt
from app.batchclient.items import Request
from app.batchclient.retry import Verdict, classify_answer

POISON = "poison"  # the input whose batch always loses the server its device
DEVICE_LOST = orjson.dumps(
    {"error": {"type": "device_lost", "code": "device_lost", "message": "a sticky CUDA error"}}
)


class PoisonClient(BatchClient):
    """500 `device_lost` to every request holding POISON, 200 to any other; counts them."""

    def __init__(self, options: ClientOptions) -> None:
        super().__init__("http://127.0.0.1:9", options)
        self.sent: list[tuple[str, ...]] = []

    async def _post(self, request: Request) -> Attempt:
        ticket = self.controller.on_send()
        texts = tuple(text for item in request.items for text in item.texts or ())
        self.sent.append(texts)
        if POISON in texts:
            return Attempt(500, DEVICE_LOST, None, 0.001, ticket)
        outputs = [[0.0] for _ in texts]
        body = orjson.dumps({"model": "m", "outputs": outputs, "usage": {"inputs": len(texts)}})
        return Attempt(200, body, None, 0.001, ticket)


FAST_RETRIES = RetryPolicy(base_backoff_s=1e-4, max_backoff_s=1e-4)


async def _run(client: BatchClient, items: list[Item]) -> list[object]:
    async with client:
        return [result async for result in client.infer_many(items)]


async def test_a_line_answered_device_lost_is_sent_once_and_fails() -> None:
    client = PoisonClient(ClientOptions(retry=FAST_RETRIES))
    [failure] = await _run(client, [Item(0, {"inputs": POISON})])
    assert isinstance(failure, Failure)
    assert (failure.status, failure.attempts, failure.retryable) == (500, 1, False)
    assert failure.error["type"] == "device_lost"
    assert client.sent == [(POISON,)]


async def test_a_pack_answered_device_lost_sends_each_line_once_more_alone() -> None:
    options = ClientOptions(concurrency=4, inputs_per_request=4, retry=FAST_RETRIES)
    client = PoisonClient(options)
    items = [Item(i, {"inputs": POISON if i == 2 else f"t{i}"}) for i in range(4)]
    results = await _run(client, items)
    assert sorted(r.id for r in results if isinstance(r, Success)) == [0, 1, 3]
    assert [(r.id, r.status) for r in results if isinstance(r, Failure)] == [(2, 500)]
    assert sum(POISON in texts for texts in client.sent) == 2  # the pack, then the line alone


def test_only_a_not_resent_error_changes_the_verdict() -> None:
    assert classify_answer(500, "device_lost").verdict is Verdict.FAIL
    assert classify_answer(500, "internal_error").verdict is Verdict.RETRY
    assert classify_answer(503, "engine_lost").verdict is Verdict.RETRY
    assert classify_answer(200, None).verdict is Verdict.SUCCESS
