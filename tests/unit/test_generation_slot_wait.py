"""A generate model's wait for a KV-cache slot (`SequenceTable.steps_until_a_slot`: a heap
simulation over its running sequences and a push and pop for each waiting one) is
simulated once after each change of its sequences, not each time it is read: every
admission of any model reads every model's work (`EngineCore._admit`), the status does
every 5 ms, and a generate request's submit again. It was simulated on each. And a
sequence whose client set no limit is planned against the wait it was admitted on, the
other models' turns included, not a slot's alone.

An in-process engine over the tiny causal LM, warm-up off, beside a stand-in embedding
model; its sequence table is filled by hand (nothing awaits meanwhile, so its step loop
does not run)."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

from app.admission import Rejected, RejectReason
from app.engine import generation_batch
from app.engine.core import EngineCore
from app.engine.generation_host import GenerationHost
from app.engine.host import EngineLoad
from app.engine.inprocess import InProcessEngine
from app.engine.kv_slots import steps_until_start
from app.engine.protocol import (
    EmbedPayload,
    Failure,
    GeneratePayload,
    ModelInfo,
    SamplingParams,
    Submit,
)
from app.metrics import Metrics
from app.model_queues import ModelWork
from tests.support.generation_engine import settings_for
from tests.support.manual_clock import ManualClock
from tests.support.stand_in_sequence import stand_in_sequence as sequence


@dataclass
class StandInEmbedder:
    """An embedding model whose work is `current`; it refuses every request (none queued)."""

    current: ModelWork
    queues_batches = True

    def info(self) -> ModelInfo:
        return ModelInfo("embed", 4, 64)

    def queued_inputs(self) -> int:
        return 0

    def batch_cost(self) -> None:
        return None

    def work(self, now: float) -> ModelWork:
        return self.current

    def admit(self, request: Submit, load: EngineLoad) -> Rejected | None:
        return Rejected(RejectReason.QUEUE, "stand-in")


@pytest.fixture
async def engine(tiny_causal_lm: Path) -> AsyncIterator[InProcessEngine]:
    """The tiny model (1 KV-cache slot, a step measured at 10 ms) beside `minilm`, idle;
    on a manual clock."""
    settings = settings_for(tiny_causal_lm, warmup=False, generate_slots=1, dispatcher_threads=1)
    engine = InProcessEngine(EngineCore(settings, Metrics(), clock=ManualClock(100.0)))
    await engine.start()
    await engine.wait_ready()
    core = engine.core
    host = core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    host._step_s = 0.010
    core.hosts["minilm"] = StandInEmbedder(ModelWork(0.0, 0.0, 0.0))  # type: ignore[assignment]
    try:
        yield engine
    finally:
        del core.hosts["minilm"]
        for sequence in host._batch.everyone():
            host._drop(sequence)
        await engine.close()


def generation_host(engine: InProcessEngine) -> GenerationHost:
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    return host


class Simulations:
    """Counts the calls of `steps_until_start` made through the sequence table."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0

        def counted(running: Iterable[int], free: int, waiting: Iterable[int]) -> int:
            self.calls += 1
            return steps_until_start(running, free, waiting)

        monkeypatch.setattr(generation_batch, "steps_until_start", counted)


def ignore(answer: object) -> None:
    pass


async def test_admissions_simulate_the_slot_wait_once_between_changes(
    engine: InProcessEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    host = generation_host(engine)
    core = engine.core
    table = host._batch
    table.queue(sequence(200))
    table.join(max_batch_tokens=64, now=0.0)
    table.queue(sequence(50))
    simulations = Simulations(monkeypatch)
    ids = itertools.count(1)
    for _ in range(20):  # embedding requests, and the status between them
        core.submit(b"fe", Submit(next(ids), "minilm", 1e12, EmbedPayload([[1, 2]])), ignore)
        queue = core.status().models["tiny"].queue
        assert queue is not None and queue.backlog_s == pytest.approx(2.5)  # 250 steps
    assert simulations.calls == 1, "simulated for every admission and every status"
    # A generate request: admitted and queued on that figure; queued, it is a change.
    payload = GeneratePayload([1, 7], SamplingParams(max_new_tokens=4))
    core.submit(b"fe", Submit(next(ids), "tiny", 1e12, payload), ignore)
    assert simulations.calls == 1
    assert len(table.waiting) == 2
    # 254 steps: the slot frees for the 50 tokens' sequence first, then for the new one.
    assert host.work(core.clock()).own_wait_s == pytest.approx(2.54)
    assert simulations.calls == 2


def fresh_steps(host: GenerationHost) -> int:
    """What the simulation says of the table now, run afresh."""
    table = host._batch
    running = [s.remaining for s in table.running.values()]
    waiting = [s.sampling.max_new_tokens for s in table.waiting]
    return steps_until_start(running, table.slots.free, waiting)


async def test_after_every_change_the_slot_wait_is_simulated_again(
    engine: InProcessEngine,
) -> None:
    """Each change of the table after the wait was read: the wait read next is a fresh
    simulation's."""
    host = generation_host(engine)
    table = host._batch

    def read() -> int:
        steps = table.steps_until_a_slot()
        assert steps == fresh_steps(host)
        assert host.work(0.0).own_wait_s == pytest.approx(steps * 0.010)
        return steps

    assert read() == 0  # a slot is free
    payload = GeneratePayload([1, 7], SamplingParams(max_new_tokens=30))
    task = host.submit(Submit(1, "tiny", 1e12, payload), ignore)  # submitted: it waits
    assert task is not None and read() == 30  # it takes the free slot, then 30 steps
    [first] = table.join(max_batch_tokens=64, now=0.0)  # joined: as the simulation had it
    assert read() == 30
    table.queue(waiting := sequence(50))  # queued: the slot frees for it first
    assert read() == 80
    eos = host.runner.eos_token_ids
    token = next(t for t in range(2, 100) if t not in eos)
    host._advance([first], [[token] * 3])  # a step's end: 3 tokens taken
    assert read() == 77
    table.remove(waiting)  # a waiting sequence removed
    assert read() == 27
    host._drop(first)  # a running one removed (cancelled): its slot is free
    assert read() == 0


async def test_a_sequence_without_a_limit_is_planned_against_its_admitted_wait(
    engine: InProcessEngine,
) -> None:
    """With `minilm` flooded, a chat request without `max_tokens` waits for what runs of
    it and its next batch (600 ms) before its first step, although a KV-cache slot is
    free, and each of its steps then waits a `minilm` batch (100 ms) too. Planned against
    the slot's wait alone (none) and its steps' compute alone, it was given 94 steps of
    10 ms of its 1.05 s; against its admitted wait alone, 40: either ran to its deadline
    and ended there, cut short."""
    core = engine.core
    host = generation_host(engine)
    flood = ModelWork(running_s=0.5, queued_s=5.0, next_batch_s=0.1, batches_ahead=50, turns=51)
    core.hosts["minilm"].current = flood  # type: ignore[attr-defined]
    sampling = SamplingParams(max_new_tokens=200, fit_to_deadline=True)
    deadline = core.clock() + 1.05
    core.submit(b"fe", Submit(1, "tiny", deadline, GeneratePayload([1, 7], sampling)), ignore)
    [sequence] = host._batch.waiting
    # 90 % of the 450 ms left after its wait, in steps of 10 ms and a 100 ms turn each.
    assert sequence.sampling.max_new_tokens == 3


async def test_a_limit_the_deadline_cannot_hold_beside_a_flood_is_refused_at_once(
    engine: InProcessEngine,
) -> None:
    """40 tokens of 10 ms fit the 450 ms its deadline leaves after the wait, but not with a
    100 ms `minilm` batch before each: refused 504 at admission, where it was admitted on
    its compute alone and failed partway, at its deadline."""
    core = engine.core
    flood = ModelWork(running_s=0.5, queued_s=5.0, next_batch_s=0.1, batches_ahead=50, turns=51)
    core.hosts["minilm"].current = flood  # type: ignore[attr-defined]
    answers: list[object] = []
    payload = GeneratePayload([1, 7], SamplingParams(max_new_tokens=40))
    core.submit(b"fe", Submit(1, "tiny", core.clock() + 1.05, payload), answers.append)
    [refusal] = answers
    assert isinstance(refusal, Failure) and refusal.reason == RejectReason.DEADLINE.value
