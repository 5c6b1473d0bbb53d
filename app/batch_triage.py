"""Whose fault is a failed batch: one input's, or the server's?

A batch fails whole when any of its inputs makes the model throw (an index past a tensor
model's embedding table, a value its code refuses). Answering every input of it 500, and
counting the failure toward the engine's ill health, let one client's bad inputs fail other
clients' requests and, sent a few times, get the pod restarted. So a known-good row of the
same shape (the warm-up's) runs first: if it fails too, the server is failing; if not, each
row of the failed batch runs again alone, the rows that compute alone are answered, and a
row that fails alone is the input's fault, once the server was seen computing (the
known-good row, or without one a row alone): until then it is only suspected, and the
server's when nothing computes. The row of a batch of one runs again alone too: an error
that passes (a transient one the server raised) must not be blamed on its input. Whatever
the input, out of memory (an allocation that failed) and a lost device are the server's
(`server_fault`), for the whole batch and for a row alone, also when a model library
wrapped them in an exception of its own.

Pure orchestration over an injected `run` (which computes rows on a compute thread and
raises what the model raised); event loop thread only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from app.failures import caused_by, device_lost, raised_by_torch

RowT = TypeVar("RowT")
OutputT = TypeVar("OutputT")


# How torch words an allocation that failed when it raises a plain `RuntimeError`, not its
# `OutOfMemoryError`: its CPU allocator ("DefaultCPUAllocator: can't allocate memory: you
# tried to allocate N bytes. Error code 12 (Cannot allocate memory)"; in older torch "...:
# not enough memory: you tried to allocate N bytes"), cuBLAS and its kin ("CUDA error:
# CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`", CUFFT_ALLOC_FAILED,
# CUSPARSE_STATUS_ALLOC_FAILED), and the CUDA runtime outside the caching allocator
# ("CUDA error: out of memory").
_ALLOCATION_FAILED = ("ALLOC_FAILED", "not enough memory", "can't allocate memory", "out of memory")


def _out_of_memory(error: BaseException) -> bool:
    return (
        isinstance(error, MemoryError)
        or type(error).__name__ == "OutOfMemoryError"
        or (raised_by_torch(error) and any(words in str(error) for words in _ALLOCATION_FAILED))
    )


def allocation_failed(error: BaseException) -> bool:
    """Whether `error`, or an exception it was raised from or while handling (a model
    library's own exception wrapping torch's: `failures.caused_by`), is an allocation that
    failed: Python's `MemoryError`, torch's `OutOfMemoryError` (by name: no torch here), or
    torch's words for one (`_ALLOCATION_FAILED`) in a plain `RuntimeError` or its
    `AcceleratorError`, as torch raises these (`failures.raised_by_torch`), never in a
    model's own exception class whose text merely says so."""
    return caused_by(error, _out_of_memory)


def server_fault(error: BaseException) -> bool:
    """Whether `error` is the server's, whatever the input: out of memory
    (`allocation_failed`: memory others' batches held, or a transient peak) or a lost
    device (`failures.device_lost`), each also when a model library wrapped it. Such a
    failure is answered 500 and counted toward the engine's ill health: blamed on an input,
    it was answered 400 and reset that count."""
    return allocation_failed(error) or device_lost(error)


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
    toward the engine's ill health. That is None only when the server was seen computing
    during the triage (its known-good row, or a row alone): only then may health hear of
    the batch as a success, which clears its count of failed batches."""

    alone: list[OutputT | RowFailed | None]
    server_error: Exception | None

    @property
    def server_failing(self) -> bool:
        return self.server_error is not None


def _as_servers(result: OutputT | RowFailed | None) -> OutputT | RowFailed | None:
    return RowFailed(result.error, servers=True) if isinstance(result, RowFailed) else result


def _all_servers(rows: Sequence[object], error: Exception) -> Triage[OutputT]:
    return Triage([RowFailed(error, servers=True)] * len(rows), server_error=error)


async def triage(
    rows: Sequence[RowT],
    batch_error: Exception,
    run: Callable[[Sequence[RowT]], Awaitable[OutputT]],
    known_good: Sequence[RowT] | None,
    *,
    still_waiting: Callable[[int], bool] = lambda index: True,
    on_input_fault: Callable[[int, RowFailed], None] = lambda index, failed: None,
    alone_after_allocation_failure: bool = False,
) -> Triage[OutputT]:
    """`rows`: those of the failed batch still waiting for an answer (the rest were
    cancelled or expired while it ran). A `batch_error` of the server's (`server_fault`)
    fails every row as the server's, none run again. Else a known-good row first
    (`known_good`; None when there is none, e.g. warm-up was off): when even that fails
    the server is failing, and no row is run again (a device that fell over would fail
    each, one slow failure after another, holding the compute slot). Else each row runs
    alone, the row of a batch of one too (its `batch_error` may have been the server's
    passing fault that `server_fault` does not know: blamed on the input unrun, it was
    answered 400 and cleared health's count, where two rows were each run again), each only
    if `still_waiting(its index)`, asked just before its run, says so (the caller answers
    a row past its deadline there, and skips a row whose request already failed: rows of
    a running batch are off the scheduler); a row alone failing the server's way fails as
    the server's, and so do the rows after it, not run.

    A row failing alone is its input's fault only once the server was seen computing:
    its known-good row computed, or (without one) a row computed alone. From that moment
    each such row is passed to `on_input_fault(its index, its RowFailed)` at once (those
    that failed before it, then each as it fails), before the next row runs, so the caller
    can answer its request and skip the request's other rows; the verdict holds it too.
    Until then a failed row is only suspected, never passed: should the server fail the
    server's way before anything computed, or nothing compute at all, it is the server's
    (500, counted toward ill health), so no row is answered 400 and then turns out the
    server's. So without a known-good row, a failed batch of which nothing
    computed alone (every row failed, or nobody waited for any) is a failure of the
    server's, `batch_error`: no evidence that the server computes
    anything, and a server whose slow failures outlast every row's deadline must still
    turn unhealthy; it is never a success that clears health's count.

    With `alone_after_allocation_failure` (a caller whose batch nothing split on out of
    memory: a generation step), a `batch_error` that is an allocation failure
    (`allocation_failed`) is no verdict: the known-good row and the rows alone run as
    above, each needing less memory than the batch; a lost device still ends it unrun."""
    retry_allocation = alone_after_allocation_failure and not device_lost(batch_error)
    if server_fault(batch_error) and not retry_allocation:
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
    seen_computing = known_good is not None
    alone: list[OutputT | RowFailed | None] = []
    for index, row in enumerate(rows):
        if not still_waiting(index):
            alone.append(None)
            continue
        try:
            output = await run([row])
        except Exception as error:  # the model's own exception, whatever it is
            if server_fault(error):
                if not seen_computing:  # the rows that failed before it were suspects
                    alone = [_as_servers(result) for result in alone]
                alone.extend([RowFailed(error, servers=True)] * (len(rows) - index))
                return Triage(alone, server_error=error)
            failed = RowFailed(error, servers=False)
            alone.append(failed)
            if seen_computing:
                on_input_fault(index, failed)
            continue
        alone.append(output)
        if not seen_computing:
            seen_computing = True
            for earlier, result in enumerate(alone):
                if isinstance(result, RowFailed):
                    on_input_fault(earlier, result)
    if not seen_computing:
        return Triage([_as_servers(result) for result in alone], server_error=batch_error)
    return Triage(alone, server_error=None)
