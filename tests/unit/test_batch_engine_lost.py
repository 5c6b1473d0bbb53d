"""A line the server answers 503 `engine_lost` again and again (the engine exited with it
in it each time: a segfault, an abort, an OOM kill) may be what kills the engine: it was
resent as any 503, up to 9 tries, each taking every other request in the engine down with
it, and a pack holding it was never split, so every line of it failed. Scripted transport
(`_post`), no server."""

from __future__ import annotations

import orjson

from app.batchclient import BatchClient, ClientOptions, Failure, Item, RetryPolicy, Success
from app.batchclient.attempt import Attempt
from app.batchclient.items import Request

KILLER = "killer"  # the input whose engine always exits with it
ENGINE_LOST = orjson.dumps(
    {"error": {"type": "engine_lost", "message": "the engine process exited (status -11)"}}
)


class KillerClient(BatchClient):
    """503 `engine_lost` to every request holding KILLER, 200 to any other; counts them.
    ``lost_once``: texts whose first request alone is answered `engine_lost` (an innocent
    line in an engine another one killed)."""

    def __init__(self, options: ClientOptions, lost_once: frozenset[str] = frozenset()) -> None:
        super().__init__("http://127.0.0.1:9", options)
        self.sent: list[tuple[str, ...]] = []
        self._lost_once = set(lost_once)

    async def _post(self, request: Request) -> Attempt:
        ticket = self.controller.on_send()
        texts = tuple(text for item in request.items for text in item.texts or ())
        self.sent.append(texts)
        lost_now = self._lost_once.intersection(texts)
        self._lost_once -= lost_now
        if KILLER in texts or lost_now:
            return Attempt(503, ENGINE_LOST, 0.0, 0.001, ticket)
        outputs = [[0.0] for _ in texts]
        body = orjson.dumps({"model": "m", "outputs": outputs, "usage": {"inputs": len(texts)}})
        return Attempt(200, body, None, 0.001, ticket)


FAST_RETRIES = RetryPolicy(base_backoff_s=1e-4, max_backoff_s=1e-4, max_retry_after_s=0.0)


async def _run(client: BatchClient, items: list[Item]) -> list[object]:
    async with client:
        return [result async for result in client.infer_many(items)]


async def test_a_line_answered_engine_lost_every_time_fails_after_few_tries() -> None:
    client = KillerClient(ClientOptions(retry=FAST_RETRIES))
    [failure] = await _run(client, [Item(0, {"inputs": KILLER})])
    assert isinstance(failure, Failure)
    bound = 3  # the default max_engine_lost_retries (2), plus the first try
    assert (failure.status, failure.attempts, failure.retryable) == (503, bound, True)
    assert client.sent == [(KILLER,)] * bound
    record = orjson.loads(failure.json_line())
    assert record["error"]["type"] == "engine_lost"  # the server's own words are kept
    assert f"engine_lost {bound} times" in record["reason"]
    assert "--retry-errors" in record["reason"]


async def test_a_pack_answered_engine_lost_every_time_is_resent_one_line_per_request() -> None:
    options = ClientOptions(concurrency=4, inputs_per_request=4, retry=FAST_RETRIES)
    client = KillerClient(options)
    items = [Item(i, {"inputs": KILLER if i == 2 else f"t{i}"}) for i in range(4)]
    results = await _run(client, items)
    assert sorted(r.id for r in results if isinstance(r, Success)) == [0, 1, 3]
    assert [(r.id, r.status) for r in results if isinstance(r, Failure)] == [(2, 503)]
    assert sum(KILLER in texts for texts in client.sent) == 3 + 3  # the pack's, then alone


async def test_an_engine_lost_now_and_then_is_retried_and_answered() -> None:
    client = KillerClient(ClientOptions(retry=FAST_RETRIES), lost_once=frozenset({"t0"}))
    [success] = await _run(client, [Item(0, {"inputs": "t0"})])
    assert isinstance(success, Success) and success.attempts == 2


async def test_the_engine_lost_limit_is_an_option() -> None:
    policy = RetryPolicy(
        base_backoff_s=1e-4, max_backoff_s=1e-4, max_retry_after_s=0.0, max_engine_lost_retries=0
    )
    client = KillerClient(ClientOptions(retry=policy))
    [failure] = await _run(client, [Item(0, {"inputs": KILLER})])
    assert isinstance(failure, Failure) and failure.attempts == 1
