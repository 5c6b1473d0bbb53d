"""Which refusals are answered without pausing their connection (`app/api/refusal_budget.py`)."""

from __future__ import annotations

from app.api.refusal_budget import RefusalBudget


def spend_all(budget: RefusalBudget) -> int:
    """Refuse until a refusal must pause; how many were answered at once."""
    answered = 0
    while budget.answer_at_once():
        answered += 1
    return answered


def test_nothing_is_answered_at_once_before_an_admission() -> None:
    assert spend_all(RefusalBudget(per_admission=2, banked_admissions=4)) == 0


def test_each_admission_earns_its_refusals() -> None:
    budget = RefusalBudget(per_admission=2, banked_admissions=4)
    # An open loop at 3x capacity: two refusals for each admission, none paused.
    for _ in range(100):
        budget.admitted()
        assert budget.answer_at_once()
        assert budget.answer_at_once()
    assert not budget.answer_at_once()


def test_a_fraction_per_admission_adds_up() -> None:
    budget = RefusalBudget(per_admission=0.5, banked_admissions=4)
    budget.admitted()
    assert not budget.answer_at_once()
    budget.admitted()
    assert budget.answer_at_once()


def test_admissions_bank_no_more_than_the_cap() -> None:
    budget = RefusalBudget(per_admission=3, banked_admissions=4)
    for _ in range(1000):  # a quiet hour of admissions and no refusal
        budget.admitted()
    assert spend_all(budget) == 12
    assert not budget.answer_at_once()  # a flood past the bank is paused


def test_zero_per_admission_pauses_every_refusal() -> None:
    budget = RefusalBudget(per_admission=0)
    budget.admitted()
    assert not budget.answer_at_once()
