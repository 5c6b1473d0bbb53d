"""A 504 that recurs for one request: the server cannot compute that request within its
deadline (steadyserve answers a long queue with 429; its 504 says the request's own
compute, or the wait its own deadline allows, does not fit). Scripted transport (`_post`),
no server."""

from __future__ import annotations

import orjson

from app.batchclient import BatchClient, ClientOptions, Failure, Item, RetryPolicy, Success
from app.batchclient.attempt import Attempt
from app.batchclient.items import Request

SLOW = "slow"  # the input the server always answers 504 for, alone or in a pack
DEADLINE = orjson.dumps(
    {"error": {"type": "deadline", "message": "the deadline leaves 9 ms, less than the 40 ms"}}
)


class SlowInputClient(BatchClient):
    """504 to every request holding the SLOW input, 200 to any other; counts requests."""

    def __init__(self, options: ClientOptions) -> None:
        super().__init__("http://127.0.0.1:9", options)
        self.sent: list[tuple[str, ...]] = []

    async def _post(self, request: Request) -> Attempt:
        ticket = self.controller.on_send()
        texts = tuple(text for item in request.items for text in item.texts or ())
        self.sent.append(texts)
        if SLOW in texts:
            return Attempt(504, DEADLINE, None, 0.001, ticket)
        outputs = [[0.0] for _ in texts]
        body = orjson.dumps({"model": "m", "outputs": outputs, "usage": {"inputs": len(texts)}})
        return Attempt(200, body, None, 0.001, ticket)


FAST_RETRIES = RetryPolicy(base_backoff_s=1e-4, max_backoff_s=1e-4)


async def _run(client: BatchClient, items: list[Item]) -> list[object]:
    async with client:
        return [result async for result in client.infer_many(items)]


async def test_a_request_answered_504_every_time_fails_after_few_tries_with_its_reason() -> None:
    """It was sent 1 + max_retries (9) times, each 504 cutting the concurrency again, and its
    record said only the server's last error."""
    client = SlowInputClient(ClientOptions(concurrency=64, retry=FAST_RETRIES, seed=1))
    items = [Item(0, {"inputs": SLOW}), *(Item(i, {"inputs": f"t{i}"}) for i in range(1, 6))]
    results = await _run(client, items)
    failures = [r for r in results if isinstance(r, Failure)]
    assert sorted(r.id for r in results if isinstance(r, Success)) == [1, 2, 3, 4, 5]
    [failure] = failures
    bound = 3  # the default max_deadline_retries (2), plus the first try
    assert failure.status == 504 and failure.attempts == bound
    assert sum(SLOW in texts for texts in client.sent) == bound
    record = orjson.loads(failure.json_line())
    assert record["error"]["type"] == "deadline"  # the server's own words are kept
    assert f"504 {bound} times" in record["reason"]
    # One request's repeated 504s are about that request, not the queue: one cut.
    assert client.stats().concurrency_cuts == 1


async def test_a_pack_answered_504_every_time_is_resent_one_line_per_request() -> None:
    """One slow input made its whole pack miss the deadline: every line of the pack landed
    in the errors file."""
    options = ClientOptions(concurrency=4, inputs_per_request=4, retry=FAST_RETRIES)
    client = SlowInputClient(options)
    items = [Item(i, {"inputs": SLOW if i == 2 else f"t{i}"}) for i in range(4)]
    results = await _run(client, items)
    assert sorted(r.id for r in results if isinstance(r, Success)) == [0, 1, 3]
    assert [(r.id, r.status) for r in results if isinstance(r, Failure)] == [(2, 504)]


async def test_504s_stay_within_max_retries_when_it_is_the_smaller() -> None:
    client = SlowInputClient(ClientOptions(retry=RetryPolicy(max_retries=0)))
    [failure] = await _run(client, [Item(0, {"inputs": SLOW})])
    assert isinstance(failure, Failure) and failure.attempts == 1
