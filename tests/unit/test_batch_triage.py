"""Telling a failing input from a failing server, over a fake model that throws on some
rows (the point here is the verdict, not the compute)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from app.batch_triage import RowFailed, server_fault, triage

BAD = -1


def model(broken: bool = False):  # type: ignore[no-untyped-def]
    """Doubles each row; throws on a BAD row, or on every row when `broken`."""

    async def run(rows: Sequence[int]) -> list[int]:
        if broken or BAD in rows:
            raise IndexError("index out of range")
        return [2 * row for row in rows]

    return run


async def test_the_good_rows_of_a_failed_batch_are_answered_and_the_bad_one_is_its_own() -> None:
    verdict = await triage([1, BAD, 3], IndexError("batch"), model(), known_good=[0])
    assert verdict.alone[0] == [2] and verdict.alone[2] == [6]
    failed = verdict.alone[1]
    assert isinstance(failed, RowFailed) and isinstance(failed.error, IndexError)
    assert not failed.servers and not verdict.server_failing


@pytest.mark.parametrize("rows", [[BAD], [BAD, BAD]])
async def test_when_no_row_computes_a_known_good_row_decides(rows: list[int]) -> None:
    verdict = await triage(rows, IndexError("batch"), model(), known_good=[0])
    assert all(
        isinstance(result, RowFailed) and isinstance(result.error, IndexError)
        for result in verdict.alone
    )
    # The known-good row computes: the inputs are at fault.
    assert not verdict.server_failing and not any(r.servers for r in verdict.alone)  # type: ignore[union-attr]
    broken = await triage(rows, IndexError("batch"), model(broken=True), known_good=[0])
    assert broken.server_failing and all(r.servers for r in broken.alone)  # type: ignore[union-attr]


async def test_a_failing_server_is_found_with_one_run_not_one_per_row() -> None:
    """A device that fell over fails every row, each failure as slow as the batch's:
    running each row again held the compute slot for as many batches as rows."""
    runs: list[Sequence[int]] = []
    broken = model(broken=True)

    async def counted(rows: Sequence[int]) -> list[int]:
        runs.append(rows)
        return await broken(rows)

    verdict = await triage([1, 2, 3, 4], IndexError("batch"), counted, known_good=[0])
    assert verdict.server_failing and runs == [[0]]


async def test_without_a_known_good_row_a_batch_where_nothing_computes_is_the_server_s() -> None:
    verdict = await triage([BAD, BAD], IndexError("batch"), model(), known_good=None)
    assert verdict.server_failing and all(r.servers for r in verdict.alone)  # type: ignore[union-attr]


def failing_once(error: Exception, runs: list[Sequence[int]]):  # type: ignore[no-untyped-def]
    """`model()`, recording each run, whose first run raises `error` (a passing fault of
    the server's that `server_fault` does not know), and every later run computes."""
    inner = model()

    async def run(rows: Sequence[int]) -> list[int]:
        runs.append(rows)
        if len(runs) == 1:
            raise error
        return await inner(rows)

    return run


@pytest.mark.parametrize("known_good", [[0], None])
async def test_the_row_of_a_batch_of_one_runs_again_alone_before_it_is_blamed(
    known_good: list[int] | None,
) -> None:
    """The row of a one-row batch that failed was blamed on its input unrun once the
    known-good row computed: a passing fault of the server's (one `server_fault` does not
    know) was answered 400 and cleared health's count (without a known-good row, 500),
    where a batch of two ran each row again and answered it."""
    runs: list[Sequence[int]] = []
    forward = failing_once(RuntimeError("a passing fault of the server's"), runs)
    with pytest.raises(RuntimeError) as batch:
        await forward([5])  # the batch of one
    verdict = await triage([5], batch.value, forward, known_good)
    assert verdict.alone == [[10]] and verdict.server_error is None
    assert runs == [[5], *([known_good] if known_good else []), [5]]


async def test_the_row_of_a_batch_of_one_that_fails_again_alone_is_its_input_s_fault() -> None:
    runs: list[Sequence[int]] = []
    inner = model()

    async def counted(rows: Sequence[int]) -> list[int]:
        runs.append(rows)
        return await inner(rows)

    handed: list[int] = []
    verdict = await triage(
        [BAD],
        IndexError("batch"),
        counted,
        known_good=[0],
        on_input_fault=lambda index, failed: handed.append(index),
    )
    [failed] = verdict.alone
    assert isinstance(failed, RowFailed) and not failed.servers
    assert str(failed.error) == "index out of range"  # its own run's error, not the batch's
    assert verdict.server_error is None and handed == [0]
    assert runs == [[0], [BAD]]


@pytest.mark.parametrize("known_good", [[0], None])
async def test_a_row_left_alone_by_the_others_going_runs_alone_before_it_is_blamed(
    known_good: list[int] | None,
) -> None:
    """The bad row's request was cancelled (or expired) while the batch ran: the one row
    still waiting is not the batch of one that failed, and must not get its error (400, or
    500 and ill health without a known-good row)."""
    verdict = await triage([1], IndexError("batch"), model(), known_good)
    assert verdict.alone == [[2]] and not verdict.server_failing


@pytest.mark.parametrize(
    ("rows", "waiting"),
    [([], True), ([BAD, BAD], False)],
    ids=["all-went", "none-still-waited-for"],
)
async def test_a_failed_batch_of_which_nothing_computed_never_clears_health(
    rows: list[int], waiting: bool
) -> None:
    """Every row went while the batch ran (its client left, or it could no longer finish
    in time), and there is no known-good row: nothing shows the server computes. That
    was a success to health (`server_error` None), which cleared its count of failed
    batches, so a server whose slow failures outlast every deadline never turned
    unhealthy. It is the batch's failure, the server's (one strike), nothing run."""
    runs: list[Sequence[int]] = []
    batch_error = IndexError("batch")
    verdict = await triage(
        rows,
        batch_error,
        counted_model(MemoryError(), runs),
        known_good=None,
        still_waiting=lambda index: waiting,
    )
    assert verdict.server_error is batch_error and runs == []
    assert verdict.alone == [None] * len(rows)


async def test_a_failed_batch_whose_rows_all_went_clears_health_if_its_known_good_row_ran() -> None:
    runs: list[Sequence[int]] = []
    verdict = await triage(
        [BAD, BAD],
        IndexError("batch"),
        counted_model(MemoryError(), runs),
        known_good=[0],
        still_waiting=lambda index: False,
    )
    assert verdict.alone == [None, None] and not verdict.server_failing and runs == [[0]]


class OutOfMemoryError(RuntimeError):
    """Named as torch's (`torch.OutOfMemoryError`): triage imports no torch."""


# cuBLAS's failed allocation, in torch's words (`TORCH_CUDABLAS_CHECK`, ATen/cuda/Exceptions.h).
CUBLAS_ALLOC_FAILED = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"
SERVER_FAULTS = [
    MemoryError(),
    OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    RuntimeError("CUDA error: an illegal memory access was encountered"),
    RuntimeError(CUBLAS_ALLOC_FAILED),
]
FAULT_IDS = ["memory", "torch-oom", "device-lost", "cublas-alloc"]
HEAVY = 7  # a row the server runs out of memory on (or loses its device on), alone


def counted_model(fault: Exception, runs: list[Sequence[int]]):  # type: ignore[no-untyped-def]
    """`model()`, recording each run, raising `fault` on a HEAVY row."""
    inner = model()

    async def run(rows: Sequence[int]) -> list[int]:
        runs.append(rows)
        if HEAVY in rows:
            raise fault
        return await inner(rows)

    return run


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=FAULT_IDS)
async def test_a_row_the_server_fails_alone_is_the_server_s_fault_and_the_rest_wait_no_more(
    fault: Exception,
) -> None:
    """Out of memory (or a lost device) alone, with the known-good row computing, was the
    row's own fault: answered 400 "could not process input (OutOfMemoryError)", and its
    batch counted healthy. The rows after it are not run: a lost device fails each."""
    runs: list[Sequence[int]] = []
    run = counted_model(fault, runs)
    verdict = await triage([1, HEAVY, BAD, 3], IndexError("batch"), run, known_good=[0])
    assert verdict.alone[0] == [2]
    assert verdict.alone[1:] == [RowFailed(fault, servers=True)] * 3
    assert verdict.server_error is fault and verdict.server_failing
    assert runs == [[0], [1], [HEAVY]]


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=FAULT_IDS)
async def test_a_batch_the_server_failed_is_not_triaged(fault: Exception) -> None:
    """Nothing runs again, not even the known-good row: whatever the inputs, the server
    failed them (a lost device fails every run; out of memory is not an input's fault)."""
    runs: list[Sequence[int]] = []
    verdict = await triage([1, 2], fault, counted_model(fault, runs), known_good=[0])
    assert verdict.alone == [RowFailed(fault, servers=True)] * 2
    assert verdict.server_error is fault and runs == []


async def test_a_lost_device_the_known_good_row_finds_is_what_health_hears_of() -> None:
    lost = RuntimeError("CUDA error: an illegal memory access was encountered")

    async def lost_device(rows: Sequence[int]) -> list[int]:
        raise lost

    batch_error = IndexError("batch")
    verdict = await triage([1, 2], batch_error, lost_device, known_good=[0])
    assert verdict.alone == [RowFailed(batch_error, servers=True)] * 2
    assert verdict.server_error is lost


@pytest.mark.parametrize("fault", SERVER_FAULTS, ids=FAULT_IDS)
async def test_without_a_known_good_row_rows_failed_before_the_server_s_fault_are_the_server_s(
    fault: Exception,
) -> None:
    """Nothing computed before the server ran out of memory: the row that failed first
    was only a suspect, and stayed its input's fault, a 400 nobody retries, for what is
    evidence of a failing server."""
    runs: list[Sequence[int]] = []
    verdict = await triage([BAD, HEAVY, 1], IndexError("batch"), counted_model(fault, runs), None)
    [suspect, heavy, after] = verdict.alone
    assert isinstance(suspect, RowFailed) and isinstance(suspect.error, IndexError)
    assert suspect.servers and heavy == after == RowFailed(fault, servers=True)
    assert verdict.server_error is fault and runs == [[BAD], [HEAVY]]
    # A row computed before: the server computes, and the bad row is its input's fault.
    computed_first = await triage(
        [1, BAD, HEAVY], IndexError("batch"), counted_model(fault, []), None
    )
    assert computed_first.alone[1] == RowFailed(computed_first.alone[1].error, servers=False)  # type: ignore[union-attr]
    assert computed_first.server_error is fault


@pytest.mark.parametrize("known_good", [[0], None])
async def test_a_row_of_its_input_s_fault_is_handed_over_as_soon_as_that_is_certain(
    known_good: list[int] | None,
) -> None:
    """Its request is answered with that failure: its other rows need not run alone,
    holding the compute slot for nobody. Certain once the server was seen computing: the
    known-good row, or without one the first row that computes alone."""
    events: list[tuple[str, object]] = []
    inner = model()

    async def run(rows: Sequence[int]) -> list[int]:
        events.append(("run", list(rows)))
        return await inner(rows)

    verdict = await triage(
        [BAD, 1, BAD, 2],
        IndexError("batch"),
        run,
        known_good,
        on_input_fault=lambda index, failed: events.append(("fault", index)),
    )
    if known_good:  # at once
        expected = [("run", [0]), ("run", [BAD]), ("fault", 0), ("run", [1])]
    else:  # once row 1 computed
        expected = [("run", [BAD]), ("run", [1]), ("fault", 0)]
    expected += [("run", [BAD]), ("fault", 2), ("run", [2])]
    assert events == expected
    assert [r.servers for r in verdict.alone if isinstance(r, RowFailed)] == [False, False]
    assert not verdict.server_failing
    if not known_good:  # the server failed before anything computed: nothing certain
        handed: list[int] = []
        await triage(
            [BAD, HEAVY],
            IndexError("batch"),
            counted_model(MemoryError(), []),
            None,
            on_input_fault=lambda index, failed: handed.append(index),
        )
        assert handed == []


@pytest.mark.parametrize("known_good", [[0], None])
async def test_a_row_nobody_waits_for_any_more_is_not_run_alone(
    known_good: list[int] | None,
) -> None:
    """`still_waiting` is asked just before each row's run: its client left, or its
    deadline passed (the caller answers it), while the batch or the rows before it ran."""
    runs: list[Sequence[int]] = []
    asked: list[int] = []

    def still_waiting(index: int) -> bool:
        asked.append(index)
        return index != 1

    verdict = await triage(
        [1, BAD, 3],
        IndexError("batch"),
        counted_model(MemoryError(), runs),
        known_good,
        still_waiting=still_waiting,
    )
    assert verdict.alone == [[2], None, [6]] and not verdict.server_failing
    assert asked == [0, 1, 2] and [BAD] not in runs


@pytest.mark.parametrize(
    "message",
    [
        CUBLAS_ALLOC_FAILED,
        "CUDA error: out of memory",
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)",
        "[enforce fail at CPUAllocator.cpp:64] . DefaultCPUAllocator: not enough memory: you "
        "tried to allocate 1073741824 bytes.",
    ],
    ids=["cublas", "cuda-runtime", "cpu-allocator", "cpu-allocator-older-torch"],
)
def test_an_allocation_torch_failed_is_the_server_s_fault(message: str) -> None:
    """Torch raises these as a plain `RuntimeError`, not its `OutOfMemoryError`: a row
    alone hitting one was blamed on its input (400, health's count cleared). A model's
    own exception saying so is still its own."""

    class ModelsOwn(RuntimeError):
        pass

    assert server_fault(RuntimeError(message))
    assert not server_fault(ModelsOwn(message)) and not server_fault(ValueError(message))


def test_torch_s_own_failed_allocation_is_the_server_s_fault() -> None:
    """As this torch words it: 1 PiB is past any address space."""
    import torch

    with pytest.raises(RuntimeError) as raised:
        torch.empty(2**50, dtype=torch.uint8)
    assert type(raised.value) is not torch.OutOfMemoryError  # by its words alone
    assert server_fault(raised.value)


async def test_a_caller_may_run_the_rows_of_a_batch_out_of_memory_alone() -> None:
    """A generation step is split by nothing on out of memory: its rows alone each need
    less (`alone_after_allocation_failure`), where the batch's allocation failure was a
    verdict and failed every row unrun. A row out of memory alone is still the server's."""
    runs: list[Sequence[int]] = []
    oom = OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    verdict = await triage(
        [1, 3, HEAVY],
        oom,
        counted_model(oom, runs),
        known_good=[0],
        alone_after_allocation_failure=True,
    )
    assert verdict.alone[:2] == [[2], [6]]
    assert verdict.alone[2] == RowFailed(oom, servers=True) and verdict.server_error is oom
    assert runs == [[0], [1], [3], [HEAVY]]


async def test_a_lost_device_is_never_run_again_even_by_such_a_caller() -> None:
    runs: list[Sequence[int]] = []
    lost = RuntimeError("CUDA error: an illegal memory access was encountered")
    verdict = await triage(
        [1, 3], lost, counted_model(lost, runs), known_good=[0], alone_after_allocation_failure=True
    )
    assert runs == [] and verdict.server_error is lost
    assert verdict.alone == [RowFailed(lost, servers=True)] * 2
