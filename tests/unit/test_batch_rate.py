"""The batch client's rate limit (`ClientOptions.rate`), checked in virtual time.

The limiter reads the event loop's clock, so on a virtual-time loop (tests/support/
virtual_time.py) each request's send time is exact: a loaded machine cannot bunch or spread
them, as it did the arrivals a real server records (the e2e test in
tests/e2e/test_batch_stub.py checks only that a whole run is no faster than the rate).
"""

from __future__ import annotations

import asyncio

import orjson

from app.batchclient import BatchClient, ClientOptions, Item, Success
from app.batchclient.attempt import Attempt
from app.batchclient.items import Request
from tests.support.virtual_time import VirtualTimeLoop


class RecordingClient(BatchClient):
    """Records when each request is sent, on the loop's clock; answers it 1 ms later."""

    def __init__(self, options: ClientOptions) -> None:
        super().__init__("http://127.0.0.1:9", options)
        self.sent_at: list[float] = []

    async def _post(self, request: Request) -> Attempt:
        self.sent_at.append(asyncio.get_running_loop().time())
        ticket = self.controller.on_send()
        await asyncio.sleep(0.001)
        body = orjson.dumps({"model": "m", "outputs": [[0.0]], "usage": {"inputs": 1}})
        return Attempt(200, body, None, 0.001, ticket)


def test_the_client_never_exceeds_its_rate_in_any_second() -> None:
    """At most rate + 1 requests in any one-second window (the bucket holds one token),
    with far more requests ready than the rate lets through, and the whole run no faster
    than the rate."""
    rate = 100.0
    client = RecordingClient(ClientOptions(concurrency=64, rate=rate))
    items = [Item(i, {"inputs": f"text {i}"}) for i in range(250)]

    async def run() -> int:
        async with client:
            return sum([1 async for r in client.infer_many(items) if isinstance(r, Success)])

    # A tick: each turn of the loop takes 1 us, or the limiter's timers can spin in place
    # (see tests/support/virtual_time.py); it can only space requests further apart.
    with asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(tick_s=1e-6)) as runner:
        assert runner.run(run()) == 250
    sent = client.sent_at
    assert len(sent) == 250
    for index, start in enumerate(sent):
        window = [t for t in sent[index:] if t < start + 1.0]
        assert len(window) <= rate + 1, f"{len(window)} requests in the second from {start}"
    assert sent[-1] - sent[0] >= (len(sent) - 1) / rate - 1e-6
