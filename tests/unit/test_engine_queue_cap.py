"""`max_queue` caps the inputs waiting for a batch: not the generate prompts waiting for a
KV slot, which the published status already leaves out (hosts here are stand-ins: the point
is which count the engine admits against)."""

from __future__ import annotations

from app.engine.core import EngineCore
from app.engine.host import BatchCost
from app.engine.protocol import EmbedPayload, FromEngine, Submit
from app.metrics import Metrics
from app.settings import Settings
from tests.support.stand_in_host import StandInHost


def test_generate_prompts_waiting_for_a_slot_do_not_fill_the_batch_queue() -> None:
    core = EngineCore(Settings(), Metrics())
    embedder = StandInHost(queued=3, cost=BatchCost(0.001, 32, 0.03, 0.001))
    generator = StandInHost(queued=60, cost=None)  # generation: no batch cost
    core.hosts = {"minilm": embedder, "tiny": generator}  # type: ignore[dict-item]
    core._ready = True
    request = Submit(1, "minilm", 1e9, EmbedPayload([[1, 2]]))
    assert core._admit(request) is None
    assert embedder.loads[0].queued_inputs == 3  # was 63: refused 429 at a small max_queue
    assert core.status().queued_inputs == 3  # the count front ends shed by


def test_the_queue_depth_gauges_count_only_inputs_waiting_for_a_batch() -> None:
    """`steadyserve_queue_depth` ("Inputs waiting for a batch") and its high-water mark
    counted generate prompts waiting for a KV slot too (already in `steadyserve_sequences`),
    so the gauge read past STEADY_MAX_QUEUE while the queue it caps was short."""
    metrics = Metrics()
    core = EngineCore(Settings(spike_reports=False), metrics)
    embedder = StandInHost(queued=3, cost=BatchCost(0.001, 32, 0.03, 0.001))
    generator = StandInHost(queued=60, cost=None)  # generation: no batch cost
    core.hosts = {"minilm": embedder, "tiny": generator}  # type: ignore[dict-item]
    core._ready = True
    answers: list[FromEngine] = []
    core.submit(b"front-end", Submit(1, "tiny", 1e9, EmbedPayload([[1, 2]])), answers.append)
    core.submit(b"front-end", Submit(2, "minilm", 1e9, EmbedPayload([[1, 2]])), answers.append)
    assert answers == [] and (generator.queued, embedder.queued) == (61, 4)  # both queued
    core.refresh_gauges()
    depth = metrics.registry.get_sample_value
    assert depth("steadyserve_queue_depth") == 4  # was 65
    assert depth("steadyserve_queue_depth_max") == 4  # was 65: the submits' high water
