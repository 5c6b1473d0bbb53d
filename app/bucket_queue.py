"""One length bucket's queued inputs, for the scheduler (pure; `app/scheduler.py`).

Arrival order and earliest deadline are two heaps, so what the scheduler asks per batch and
per wake (the oldest input, the earliest deadline, the inputs past a time, the `rows` most
urgent ones) costs O(log n) in queued inputs, not a scan of the queue: under overload on a
GPU n reaches hundreds to `max_queue`.

An input's place in arrival order is its `enqueued_at`, then the order it was pushed: the
batcher stamps inputs with its monotonic clock as it pushes them, so this is the order they
came in; one a batch hands back (`Scheduler._take`) goes after those of its `enqueued_at`
still queued. Among equal deadlines the earlier in arrival order is the more urgent.

Taking an input out from anywhere (cancelled, withdrawn, expired) forgets it at once; its
heap entries go stale and are skipped as they reach the top, and a heap is rebuilt from the
live inputs once its stale entries outnumber them, so memory stays within twice the queue
and each rebuild is paid for by the removals that made it stale.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from app.scheduler import WorkItem

# Entries: the sort key, then the input's push number (unique: it breaks every tie, and
# tells an entry of the input's current push from a stale one of an earlier push), then it.
_ByArrival = tuple[float, int, "WorkItem"]
_ByDeadline = tuple[float, float, int, "WorkItem"]
_SLACK = 32  # stale entries tolerated beyond the live count before a rebuild


class BucketQueue:
    """The queued inputs of one length bucket, by arrival and by deadline."""

    __slots__ = ("_by_arrival", "_by_deadline", "_live", "_pushes")

    def __init__(self) -> None:
        self._live: dict[int, tuple[int, WorkItem]] = {}  # id -> (its push number, input)
        self._by_arrival: list[_ByArrival] = []
        self._by_deadline: list[_ByDeadline] = []
        self._pushes = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def push(self, item: WorkItem) -> None:
        """Queue an input (its id must not be queued already)."""
        push = next(self._pushes)
        self._live[item.item_id] = (push, item)
        heapq.heappush(self._by_arrival, (item.enqueued_at, push, item))
        heapq.heappush(self._by_deadline, (item.deadline, item.enqueued_at, push, item))

    def oldest(self) -> WorkItem:
        """The first input in arrival order (the queue must not be empty)."""
        heap = self._by_arrival
        while not self._is_live(heap[0][1], heap[0][2]):
            heapq.heappop(heap)
        return heap[0][2]

    def earliest_deadline(self) -> float:
        """The earliest deadline queued (the queue must not be empty)."""
        heap = self._by_deadline
        while not self._is_live(heap[0][2], heap[0][3]):
            heapq.heappop(heap)
        return heap[0][0]

    def pop_earliest(self, count: int) -> list[WorkItem]:
        """Take out the `count` most urgent inputs (at most the queue's), most urgent first:
        by deadline, equal deadlines in arrival order."""
        taken: list[WorkItem] = []
        while len(taken) < count and self._live:
            self.earliest_deadline()  # the top is live now
            item = heapq.heappop(self._by_deadline)[3]
            del self._live[item.item_id]
            taken.append(item)
        self._compact()
        return taken

    def pop_due(self, limit: float) -> list[WorkItem]:
        """Take out every input whose deadline is at or before `limit`, in arrival order."""
        due: list[_ByArrival] = []
        while self._live and self.earliest_deadline() <= limit:
            _, enqueued_at, push, item = heapq.heappop(self._by_deadline)
            del self._live[item.item_id]
            due.append((enqueued_at, push, item))
        if not due:
            return []
        self._compact()
        return [entry[2] for entry in sorted(due)]

    def remove(self, item_ids: Iterable[int]) -> list[WorkItem]:
        """Take out those of `item_ids` queued here, in arrival order."""
        removed: list[_ByArrival] = []
        for item_id in item_ids:
            entry = self._live.pop(item_id, None)
            if entry is not None:
                push, item = entry
                removed.append((item.enqueued_at, push, item))
        self._compact()
        return [entry[2] for entry in sorted(removed)]

    def take_all(self) -> list[WorkItem]:
        """Take out every input, in arrival order."""
        entries = sorted((item.enqueued_at, push, item) for push, item in self._live.values())
        self._live.clear()
        self._by_arrival.clear()
        self._by_deadline.clear()
        return [entry[2] for entry in entries]

    def _is_live(self, push: int, item: WorkItem) -> bool:
        entry = self._live.get(item.item_id)
        return entry is not None and entry[0] == push

    def _compact(self) -> None:
        """Rebuild a heap whose stale entries outnumber the live inputs."""
        bound = 2 * len(self._live) + _SLACK
        if len(self._by_arrival) > bound:
            self._by_arrival = [(i.enqueued_at, push, i) for push, i in self._live.values()]
            heapq.heapify(self._by_arrival)
        if len(self._by_deadline) > bound:
            self._by_deadline = [
                (i.deadline, i.enqueued_at, push, i) for push, i in self._live.values()
            ]
            heapq.heapify(self._by_deadline)
