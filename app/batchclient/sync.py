"""``SyncBatchClient``: the batch client for code without an event loop. It runs a loop of
its own, on the calling thread, while its results are iterated."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

from app.batchclient.client import BatchClient
from app.batchclient.items import Item, Result
from app.batchclient.options import ClientOptions
from app.batchclient.stats import BatchStats


class SyncBatchClient:
    """The same client for programs without an event loop (Airflow or Ray tasks).

    ``infer_many`` runs an event loop of its own while you iterate it: requests progress
    between the results you take, not while your code handles one. Not for use inside a
    running event loop (use ``BatchClient`` there).
    """

    def __init__(self, url: str, options: ClientOptions | None = None) -> None:
        self.url = url
        self.options = options or ClientOptions()
        self.last_stats: BatchStats | None = None

    def infer_many(self, items: Iterable[Item]) -> Iterator[Result]:
        loop = asyncio.new_event_loop()
        client = BatchClient(self.url, self.options)
        loop.run_until_complete(client.__aenter__())
        results = client.infer_many(items)
        try:
            while True:
                try:
                    yield loop.run_until_complete(anext(results))
                except StopAsyncIteration:
                    return
        finally:
            loop.run_until_complete(results.aclose())
            self.last_stats = client.stats()
            loop.run_until_complete(client.__aexit__(None, None, None))
            loop.close()
