"""`check_answers` (loadtest/frontend_cost.py): a run priced as all admitted or all refused
must be all of its kind, else the bench fails instead of pricing a mix."""

from __future__ import annotations

import pytest

from loadtest.frontend_cost import check_answers


def _result(**counts: int) -> dict[str, int]:
    return {"ok": 0, "throttled": 0, "unavailable": 0, "server_error": 0, "other": 0, **counts}


@pytest.mark.parametrize("refusal", ["throttled", "unavailable", "server_error"])
def test_an_admitted_run_with_a_refusal_or_5xx_fails(refusal: str) -> None:
    with pytest.raises(RuntimeError, match="all admitted"):
        check_answers(_result(ok=1000, **{refusal: 1}), admitted=True, path="/infer")


def test_a_refused_run_with_a_200_fails() -> None:
    with pytest.raises(RuntimeError, match="all refused"):
        check_answers(_result(ok=1, throttled=1000), admitted=False, path="/infer")


def test_runs_of_one_kind_pass() -> None:
    check_answers(_result(ok=1000), admitted=True, path="/infer")
    check_answers(_result(throttled=900, unavailable=100), admitted=False, path="/infer")


def test_a_4xx_other_than_429_fails_either_way() -> None:
    with pytest.raises(RuntimeError, match="neither 2xx nor refusals"):
        check_answers(_result(ok=10, other=1), admitted=True, path="/infer")
