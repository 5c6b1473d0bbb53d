"""Compute slots go to the hosts in the order they claimed them, whichever loop resumes
first after a slot is given back."""

from __future__ import annotations

import pytest

from app.compute_slots import ComputeSlots


def test_a_slot_given_back_is_kept_for_the_head_of_the_line() -> None:
    slots = ComputeSlots(1)
    slots.take("generation")
    slots.claim("embedder")  # ready while generation computes
    slots.give()
    # The generation loop resumes first and wants the slot again: not its turn.
    assert not slots.available("generation")
    slots.claim("generation")
    assert slots.available("embedder")
    slots.take("embedder")
    slots.give()
    assert slots.available("generation")


def test_each_free_slot_serves_one_claimant_in_order() -> None:
    slots = ComputeSlots(2)
    slots.take("a")
    slots.take("b")
    for claimant in ("c", "d", "e"):
        slots.claim(claimant)
    slots.give()
    assert [slots.available(c) for c in ("c", "d", "e", "newcomer")] == [
        True,
        False,
        False,
        False,
    ]
    with pytest.raises(RuntimeError):
        slots.take("d")


def test_a_claimant_with_nothing_left_to_run_lets_the_line_move() -> None:
    slots = ComputeSlots(1)
    slots.claim("a")
    slots.claim("b")
    assert not slots.available("b")
    slots.withdraw("a")  # its inputs expired while it waited
    assert slots.available("b")
    slots.withdraw("nobody")  # not in line: nothing happens
    assert slots.available("b")


def test_standing_puts_a_claimant_in_line_only_while_it_waits() -> None:
    slots = ComputeSlots(1)
    slots.take("a")
    slots.stand("b", waiting=True)
    slots.stand("c", waiting=True)
    slots.stand("b", waiting=False)  # its work expired: out of the line
    slots.give()
    assert slots.available("c") and not slots.available("b")


def test_a_claimant_getting_in_line_is_told_to_whoever_holds_a_slot_for_a_run() -> None:
    """A generation run holds its slot for several steps: the holder hears of each new
    claimant in line (and ends its run after its current step), not of one already there."""
    slots = ComputeSlots(1)
    heard: list[str] = []
    slots.on_claim(lambda: heard.append("claim"))
    slots.take("generation")
    slots.claim("embedding")
    slots.claim("embedding")  # already in line: nothing new to hear
    slots.stand("other", waiting=False)  # not waiting: not in line
    assert heard == ["claim"]
    slots.stand("other", waiting=True)
    assert heard == ["claim", "claim"]
    assert slots.line_waits()  # whoever takes a slot now for a run: one step
    slots.withdraw("embedding")
    slots.withdraw("other")
    assert not slots.line_waits()
