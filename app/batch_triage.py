"""Whose fault is a failed batch: one input's, or the server's?

A batch fails whole when any of its inputs makes the model throw (an index past a tensor
model's embedding table, a value its code refuses). Answering every input of it 500, and
counting the failure toward the engine's ill health, let one client's bad inputs fail other
clients' requests and, sent a few times, get the pod restarted. So a known-good row of the
same shape (the warm-up's) runs first: if it fails too, the server is failing; if not, each
row of the failed batch runs again alone, the rows that compute alone are answered, and a
row that fails alone is the input's fault.

Pure orchestration over an injected `run` (which computes rows on a compute thread and
raises what the model raised); event loop thread only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

RowT = TypeVar("RowT")
OutputT = TypeVar("OutputT")


@dataclass(frozen=True, slots=True)
class Triage(Generic[OutputT]):
    """Each row's output alone (or what it raised alone), and whether the server itself is
    failing (nothing computed, not even a known-good row)."""

    alone: list[OutputT | Exception]
    server_failing: bool


async def triage(
    rows: Sequence[RowT],
    batch_error: Exception,
    run: Callable[[Sequence[RowT]], Awaitable[OutputT]],
    known_good: Sequence[RowT] | None,
    *,
    batch_rows: int,
) -> Triage[OutputT]:
    """`rows`: those of the failed batch still waiting for an answer (of its `batch_rows`;
    the rest were cancelled or expired while it ran). A known-good row first (`known_good`;
    None when there is none, e.g. warm-up was off): when even that fails the server is
    failing, and no row is run again (a device that fell over would fail each, one slow
    failure after another, holding the compute slot). Else each row runs alone (a batch of
    one row already did: its `batch_error` is its own, and only then: a row left alone by
    the others' going is not the one that failed); without a known-good row, the server is
    failing when rows waited and none computes alone."""
    if known_good is not None:
        try:
            await run(known_good)
        except Exception:
            return Triage([batch_error] * len(rows), server_failing=True)
    if batch_rows == 1:
        return Triage([batch_error] * len(rows), server_failing=known_good is None and bool(rows))
    alone: list[OutputT | Exception] = []
    for row in rows:
        try:
            alone.append(await run([row]))
        except Exception as error:  # the model's own exception, whatever it is
            alone.append(error)
    computed = any(not isinstance(result, Exception) for result in alone)
    return Triage(alone, server_failing=known_good is None and bool(rows) and not computed)
