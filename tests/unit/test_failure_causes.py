"""An allocation that failed in torch is the server's fault also when a model library wrapped
it in an exception of its own (raised `from` it, or while handling it): one walk of the cause
chain (`failures.caused_by`) serves it and the lost device alike."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from app.batch_triage import RowFailed, server_fault, triage
from app.failures import device_lost

CUBLAS_ALLOC_FAILED = "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"


class ModelError(Exception):
    """A model library's own exception class (its forward's), as transformers' are."""


class OutOfMemoryError(RuntimeError):
    """Named as torch's (`torch.OutOfMemoryError`)."""


def raised_from(cause: BaseException) -> ModelError:
    try:
        raise ModelError("the model's forward failed") from cause
    except ModelError as wrapped:
        return wrapped


def raised_while_handling(error: BaseException) -> ModelError:
    try:
        try:
            raise error
        except BaseException:
            raise ModelError("the model's forward failed")  # noqa: B904
    except ModelError as wrapped:
        return wrapped


def torch_allocation_failure() -> RuntimeError:
    """Torch's own, as this torch words it: 1 PiB is past any address space."""
    import torch

    try:
        torch.empty(2**50, dtype=torch.uint8)
    except RuntimeError as error:
        return error
    raise AssertionError("1 PiB was allocated")


@pytest.mark.parametrize("wrap", [raised_from, raised_while_handling], ids=["from", "during"])
async def test_a_real_torch_allocation_failure_a_model_library_wrapped_is_the_server_s(
    wrap: object,
) -> None:
    """Only the error's own text was read: a model's exception wrapping torch's failed
    allocation was blamed on the row's input (400, health's count of failures reset)."""
    wrapped = wrap(torch_allocation_failure())  # type: ignore[operator]
    assert server_fault(wrapped)

    async def run(rows: Sequence[int]) -> list[int]:
        if 7 in rows:
            raise wrapped
        return list(rows)

    verdict = await triage([1, 7], ValueError("batch"), run, known_good=[0])
    assert verdict.alone == [[1], RowFailed(wrapped, servers=True)]
    assert verdict.server_error is wrapped


@pytest.mark.parametrize(
    "cause",
    [
        RuntimeError(CUBLAS_ALLOC_FAILED),
        RuntimeError("CUDA error: out of memory"),
        OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        MemoryError(),
    ],
    ids=["cublas", "cuda-runtime", "torch-oom", "memory"],
)
def test_torch_s_words_for_a_failed_allocation_are_read_through_the_model_s_wrapping(
    cause: BaseException,
) -> None:
    assert server_fault(raised_from(cause)) and server_fault(raised_while_handling(cause))
    assert server_fault(raised_from(raised_from(cause)))  # wrapped twice


def test_a_model_s_own_words_are_still_its_own_however_wrapped() -> None:
    assert not server_fault(raised_from(ModelError(CUBLAS_ALLOC_FAILED)))
    assert not server_fault(raised_from(ValueError("out of memory")))
    assert not server_fault(raised_from(IndexError("index 9 is out of bounds")))


def test_the_walk_ends_on_a_cycle_and_past_its_bound() -> None:
    first, second = ModelError("a"), ModelError("b")
    first.__context__, second.__context__ = second, first
    assert not server_fault(first) and not device_lost(first)

    def chain(links: int) -> BaseException:
        error: BaseException = RuntimeError(CUBLAS_ALLOC_FAILED)
        for _ in range(links):
            error = raised_from(error)
        return error

    from app.failures import MAX_CAUSES

    assert server_fault(chain(MAX_CAUSES - 1))  # the last one the walk reads
    assert not server_fault(chain(MAX_CAUSES))


def test_an_error_raised_from_none_hides_what_it_was_handling() -> None:
    """`raise ModelError(...) from None` in a handler of torch's allocation failure (a
    library that recovered from it, then found the input at fault) says the failure is not
    its cause, and a traceback does not print it: the walk followed `__context__` anyway,
    and blamed the server (500, a health strike) for the input's 400."""
    try:
        try:
            raise RuntimeError(CUBLAS_ALLOC_FAILED)
        except RuntimeError:
            raise ModelError("the input has no tokens") from None
    except ModelError as error:
        assert not server_fault(error)
