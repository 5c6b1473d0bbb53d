"""locust scenario for steadyserve: realistic mixed inputs to ``/infer`` along ramp stages.

Headless, with CSV output and a non-zero exit status on any failure (run from the
repository root so that ``loadtest`` imports):

    locust -f loadtest/locustfile.py --headless --host http://127.0.0.1:8000 \\
        --csv loadtest/results/locust --exit-code-on-error 1 --only-summary

Environment (all optional):

- ``LOADTEST_STAGES``: users over time in `loadtest.stages` syntax, default
  ``30s:0-50,60s:50,30s:50-500,60s:500,30s:500-5000,60s:5000`` (50 -> 500 -> 5000);
  the run ends after the last stage.
- ``LOADTEST_WORDS``: sentence lengths, default ``lognormal:12:0.8`` (mostly short, a
  long tail, so several length buckets are used).
- ``LOADTEST_BATCH_SHARE``: share of requests that send a list of 2-8 texts (default 0.2).
- ``LOADTEST_ALLOW_429``: ``1`` to count 429s as expected load shedding, not failures.
- ``LOADTEST_TIMEOUT_MS``: sets ``timeout_ms`` in every request.

Users send back to back (no think time), like a batch orchestrator's workers.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any

from locust import FastHttpUser, LoadTestShape, constant, task

from loadtest.bodies import LengthDistribution, sentence
from loadtest.stages import parse_stages, target_at, total_duration

DEFAULT_STAGES = "30s:0-50,60s:50,30s:50-500,60s:500,30s:500-5000,60s:5000"
_BODY_COUNT = 500


def _make_bodies() -> list[tuple[str, int]]:
    """Ready-made JSON bodies with how many outputs each must get back."""
    rng = random.Random(int(os.environ.get("LOADTEST_SEED", "0")))
    lengths = LengthDistribution.parse(os.environ.get("LOADTEST_WORDS", "lognormal:12:0.8"))
    batch_share = float(os.environ.get("LOADTEST_BATCH_SHARE", "0.2"))
    timeout_ms = os.environ.get("LOADTEST_TIMEOUT_MS")
    bodies: list[tuple[str, int]] = []
    for _ in range(_BODY_COUNT):
        count = rng.randint(2, 8) if rng.random() < batch_share else 1
        texts = [sentence(lengths.sample(rng), rng) for _ in range(count)]
        document: dict[str, Any] = {"inputs": texts[0] if count == 1 else texts}
        if timeout_ms:
            document["timeout_ms"] = float(timeout_ms)
        bodies.append((json.dumps(document, separators=(",", ":")), count))
    return bodies


BODIES = _make_bodies()
ALLOW_429 = os.environ.get("LOADTEST_ALLOW_429") == "1"
HEADERS = {"Content-Type": "application/json"}


class InferUser(FastHttpUser):
    wait_time = constant(0)

    def on_start(self) -> None:
        self._next = random.randrange(len(BODIES))

    @task
    def infer(self) -> None:
        body, expected_outputs = BODIES[self._next]
        self._next = (self._next + 1) % len(BODIES)
        name = "/infer [1 input]" if expected_outputs == 1 else "/infer [list]"
        with self.client.post(
            "/infer", data=body, headers=HEADERS, name=name, catch_response=True
        ) as response:
            if response.status_code == 200:
                outputs = (response.json() or {}).get("outputs", [])
                if len(outputs) == expected_outputs:
                    response.success()
                else:
                    response.failure(f"{len(outputs)} outputs for {expected_outputs} inputs")
            elif response.status_code == 429 and ALLOW_429:
                response.success()
            else:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")


class StagesShape(LoadTestShape):
    """Users follow ``LOADTEST_STAGES``; the run stops after the last stage."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.stages = parse_stages(os.environ.get("LOADTEST_STAGES", DEFAULT_STAGES))
        self.duration_s = total_duration(self.stages)

    def tick(self) -> tuple[int, float] | None:
        run_time = self.get_run_time()  # type: ignore[no-untyped-call]
        if run_time >= self.duration_s:
            return None
        users = max(round(target_at(self.stages, run_time)), 0)
        # Spawning as fast as the target moves keeps the ramp on schedule, but at least
        # 1 user/s so that a hold after a ramp is reached.
        return users, float(max(users, 1))
