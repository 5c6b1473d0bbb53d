"""The AIMD controller and the retry policy: pure, driven step by step."""

from __future__ import annotations

import random

import pytest

from app.batchclient.pacing import AimdController
from app.batchclient.retry import RetryPolicy, Verdict, classify_status


def _succeed_full_windows(controller: AimdController, rounds: int) -> None:
    """``rounds`` round trips in which every slot of the window is used and answered."""
    for _ in range(rounds):
        limit = controller.limit
        tickets = [controller.on_send() for _ in range(limit)]
        for ticket in tickets:
            controller.on_success(ticket, in_flight=controller.limit)


def test_slow_start_doubles_each_round_trip_up_to_the_maximum() -> None:
    controller = AimdController(100, initial=4)
    _succeed_full_windows(controller, 1)
    assert controller.limit == 8
    _succeed_full_windows(controller, 1)
    assert controller.limit == 16
    _succeed_full_windows(controller, 5)
    assert controller.limit == 100


def test_congestion_halves_once_per_window_then_grows_by_one_per_round_trip() -> None:
    controller = AimdController(100, initial=32)
    tickets = [controller.on_send() for _ in range(32)]
    # A whole window answered 429 cuts the limit once, not 32 times.
    cuts = [controller.on_congestion(ticket) for ticket in tickets]
    assert cuts.count(True) == 1
    assert controller.limit == 16
    _succeed_full_windows(controller, 1)
    assert controller.limit == 17  # additive now, not slow start
    _succeed_full_windows(controller, 3)
    assert controller.limit == 20


def test_a_request_sent_after_the_cut_can_cut_again() -> None:
    controller = AimdController(64, initial=64)
    controller.on_congestion(controller.on_send())
    assert controller.limit == 32
    controller.on_congestion(controller.on_send())
    assert controller.limit == 16


def test_limit_never_leaves_its_bounds() -> None:
    controller = AimdController(8, min_limit=1, initial=2)
    for _ in range(10):
        controller.on_congestion(controller.on_send())
    assert controller.limit == 1
    assert controller.snapshot().lowest_limit == 1
    _succeed_full_windows(controller, 200)
    assert controller.limit == 8


def test_successes_with_an_unused_window_do_not_grow_it() -> None:
    controller = AimdController(100, initial=10)
    for _ in range(1000):
        controller.on_success(controller.on_send(), in_flight=3)
    assert controller.limit == 10


def test_fixed_controller_stays_at_its_maximum() -> None:
    controller = AimdController(64, adaptive=False)
    assert controller.limit == 64
    assert not controller.on_congestion(controller.on_send())
    assert controller.limit == 64


@pytest.mark.parametrize(
    ("status", "verdict", "congestion"),
    [
        (200, Verdict.SUCCESS, False),
        (429, Verdict.RETRY, True),
        (503, Verdict.RETRY, False),
        (504, Verdict.RETRY, True),
        (500, Verdict.RETRY, False),
        (422, Verdict.FAIL, False),
        (413, Verdict.FAIL, False),
        (404, Verdict.FAIL, False),
    ],
)
def test_classify_status(status: int, verdict: Verdict, congestion: bool) -> None:
    outcome = classify_status(status)
    assert (outcome.verdict, outcome.congestion) == (verdict, congestion)


def test_retry_after_is_a_floor_with_bounded_jitter() -> None:
    policy = RetryPolicy(retry_after_jitter=0.5)
    rng = random.Random(7)
    delays = [policy.delay_s(1, 2.0, rng) for _ in range(500)]
    assert min(delays) >= 2.0
    assert max(delays) <= 3.0
    assert max(delays) - min(delays) > 0.5  # spread, so a fleet does not return as one wave


def test_backoff_grows_exponentially_up_to_its_cap() -> None:
    policy = RetryPolicy(base_backoff_s=0.1, max_backoff_s=1.0)
    rng = random.Random(3)
    for attempt, ceiling in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (9, 1.0)):
        delays = [policy.delay_s(attempt, None, rng) for _ in range(100)]
        assert ceiling / 2 <= min(delays) and max(delays) <= ceiling
