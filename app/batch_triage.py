"""Whose fault is a failed batch: one input's, or the server's?

A batch fails whole when any of its inputs makes the model throw (an index past a tensor
model's embedding table, a value its code refuses). Answering every input of it 500, and
counting the failure toward the engine's ill health, let one client's bad inputs fail other
clients' requests and, sent a few times, get the pod restarted. So a known-good row of the
same shape (the warm-up's) runs first: if it fails too, the server is failing; if not, each
row of the failed batch runs again alone, the rows that compute alone are answered, and a
row that fails alone is the input's fault. Whatever the input, out of memory and a lost
device are the server's (`server_fault`), for the whole batch and for a row alone.

Pure orchestration over an injected `run` (which computes rows on a compute thread and
raises what the model raised); event loop thread only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from app.failures import device_lost

RowT = TypeVar("RowT")
OutputT = TypeVar("OutputT")


def server_fault(error: BaseException) -> bool:
    """Whether `error` is the server's, whatever the input: out of memory (Python's
    `MemoryError`, torch's `OutOfMemoryError`, by name: no torch here; memory others'
    batches held, or a transient peak) or a lost device (`failures.device_lost`).
    Such a failure is answered 500 and counted toward the engine's ill health: blamed on
    an input, it was answered 400 and reset that count."""
    return (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"
        or device_lost(error)
    )


@dataclass(frozen=True, slots=True)
class RowFailed:
    """A row that did not compute: what was raised, and whose fault that is: the
    server's (`servers`: 500, counted toward ill health) or its input's (400)."""

    error: Exception
    servers: bool


@dataclass(frozen=True, slots=True)
class Triage(Generic[OutputT]):
    """Each row's output alone, or its `RowFailed`, or None for a row not run because
    nobody waits for it any more (`still_waiting` said so); and the failure to count
    toward the engine's ill health, None when inputs alone were at fault."""

    alone: list[OutputT | RowFailed | None]
    server_error: Exception | None

    @property
    def server_failing(self) -> bool:
        return self.server_error is not None


def _all_servers(rows: Sequence[object], error: Exception) -> Triage[OutputT]:
    return Triage([RowFailed(error, servers=True)] * len(rows), server_error=error)


async def triage(
    rows: Sequence[RowT],
    batch_error: Exception,
    run: Callable[[Sequence[RowT]], Awaitable[OutputT]],
    known_good: Sequence[RowT] | None,
    *,
    batch_rows: int,
    still_waiting: Callable[[int], bool] = lambda index: True,
) -> Triage[OutputT]:
    """`rows`: those of the failed batch still waiting for an answer (of its `batch_rows`;
    the rest were cancelled or expired while it ran). A `batch_error` of the server's
    (`server_fault`) fails every row as the server's, none run again. Else a known-good
    row first (`known_good`; None when there is none, e.g. warm-up was off): when even that
    fails the server is failing, and no row is run again (a device that fell over would
    fail each, one slow failure after another, holding the compute slot). Else each row
    runs alone (a batch of one row already did: its `batch_error` is its own, and only
    then: a row left alone by the others' going is not the one that failed), each only
    if `still_waiting(its index)`, asked just before its run, says so (the caller answers
    a row past its deadline there: rows of a running batch are off the scheduler); a row
    alone failing the server's way fails as the server's, and so do the rows after it, not
    run. Without a known-good row, the server is failing when rows ran and none computed
    alone."""
    if server_fault(batch_error):
        return _all_servers(rows, batch_error)
    if known_good is not None:
        try:
            await run(known_good)
        except Exception as error:
            # Each row fails with its batch's error; health hears of a lost device the
            # known-good row found.
            alone_failed: list[OutputT | RowFailed | None] = [RowFailed(batch_error, True)] * len(
                rows
            )
            return Triage(alone_failed, error if server_fault(error) else batch_error)
    if batch_rows == 1:
        if known_good is None and rows:
            return _all_servers(rows, batch_error)
        return Triage([RowFailed(batch_error, servers=False)] * len(rows), server_error=None)
    alone: list[OutputT | RowFailed | None] = []
    for index, row in enumerate(rows):
        if not still_waiting(index):
            alone.append(None)
            continue
        try:
            alone.append(await run([row]))
        except Exception as error:  # the model's own exception, whatever it is
            if server_fault(error):
                alone.extend([RowFailed(error, servers=True)] * (len(rows) - index))
                return Triage(alone, server_error=error)
            alone.append(RowFailed(error, servers=False))
    ran = [result for result in alone if result is not None]
    if known_good is None and ran and all(isinstance(result, RowFailed) for result in ran):
        failed = [
            RowFailed(r.error, servers=True) if isinstance(r, RowFailed) else r for r in alone
        ]
        return Triage(failed, server_error=batch_error)
    return Triage(alone, server_error=None)
