"""The `generate` task through the engine protocol, with the tiny random-weight causal LM:
greedy results equal `model.generate` one prompt at a time, while 20 sequences of different
lengths join and leave a running batch of 8 slots; EOS and length endings; cancellation and
oversized requests; seeded sampling; multi-step decoding (several decode steps per
dispatch) giving the tokens of single steps, ending at EOS inside a run, and letting an
arrival join without waiting for the run."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import pytest_asyncio
from transformers import AutoTokenizer, PreTrainedModel

from app.admission import Rejected, RejectReason
from app.engine.client import EngineRefused
from app.engine.core import EngineCore
from app.engine.generation_host import GenerationHost
from app.engine.generation_sequences import GenerationSequence
from app.engine.inprocess import InProcessEngine
from app.engine.protocol import (
    EmbedOutput,
    EmbedPayload,
    FinishReason,
    FromEngine,
    GeneratePayload,
    Output,
    SamplingParams,
    Submit,
    TokensOutput,
    frontend_identity,
)
from app.failures import DeadlineExceeded
from app.metrics import Metrics
from app.model_specs import ModelSpec
from app.models.causal_lm import CausalLMRunner, StepRow
from app.settings import Settings
from tests.support.generation import generate_settings, load_reference, reference_greedy
from tests.support.tiny_causal_lm import CORPUS, build_tiny_causal_lm

pytestmark = pytest.mark.asyncio(loop_scope="module")

SLOTS = 8
SLOT_TOKENS = 256
PROMPTS = [
    text[:cut] for text in CORPUS for cut in (12, 200) if len(text) > 12
]  # 20 prompts, 4 to 30 tokens


def settings_for(source: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {"engine": "inprocess", **overrides}
    return generate_settings({"tiny": source}, slots=SLOTS, slot_tokens=SLOT_TOKENS, **values)


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    finish_reason: FinishReason | None
    outputs: int
    prompt_tokens: int
    sizes: tuple[int, ...] = ()  # tokens in each output, in order


async def started(settings: Settings) -> InProcessEngine:
    engine = InProcessEngine(EngineCore(settings, Metrics()))
    await engine.start()
    await engine.wait_ready()
    return engine


async def generate(
    engine: InProcessEngine, prompt_ids: list[int], sampling: SamplingParams, stream: bool = True
) -> Generated:
    request = Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 120,
        GeneratePayload(prompt_ids, sampling, stream=stream),
    )
    return await collect(engine.stream(request))


async def collect(stream: AsyncIterator[Output]) -> Generated:
    tokens: list[int] = []
    sizes: list[int] = []
    finish = None
    prompt_tokens = -1
    async for output in stream:
        payload = output.payload
        assert isinstance(payload, TokensOutput)
        tokens.extend(payload.token_ids)
        sizes.append(len(payload.token_ids))
        finish = payload.finish_reason
        prompt_tokens = payload.prompt_tokens
    return Generated(tokens, finish, len(sizes), prompt_tokens, tuple(sizes))


def submit(engine: InProcessEngine, prompt_ids: list[int], sampling: SamplingParams) -> Submit:
    return Submit(
        engine.next_request_id(),
        "tiny",
        time.monotonic() + 120,
        GeneratePayload(prompt_ids, sampling),
    )


@pytest.fixture(scope="module")
def reference(tiny_causal_lm: Path) -> tuple[AutoTokenizer, PreTrainedModel]:
    tokenizer, model = load_reference(tiny_causal_lm)
    return tokenizer, model


def expected_greedy(
    model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int
) -> Generated:
    """model.generate on one prompt, no padding; the EOS token is not part of the result."""
    result = reference_greedy(model, prompt_ids, max_new_tokens)
    finish = FinishReason.EOS if result.at_eos else FinishReason.LENGTH
    return Generated(result.token_ids, finish, 0, len(prompt_ids))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tiny_causal_lm: Path) -> AsyncIterator[InProcessEngine]:
    engine = await started(settings_for(tiny_causal_lm))
    yield engine
    await engine.close()


async def test_greedy_equals_generate_one_prompt_at_a_time(
    engine: InProcessEngine, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]
    assert len(prompts) >= 16 and len({len(p) for p in prompts}) >= 8
    lengths = [8 + (index * 7) % 25 for index in range(len(prompts))]
    cache = engine.core.hosts["tiny"].runner.cache  # type: ignore[attr-defined]
    storage = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    registry = engine.core.metrics.registry
    labels = {"model": "tiny"}
    tokens_before = registry.get_sample_value("steadyserve_output_tokens_total", labels) or 0
    firsts_before = (
        registry.get_sample_value("steadyserve_time_to_first_token_seconds_count", labels) or 0
    )
    results = await asyncio.gather(
        *(
            generate(engine, prompt, SamplingParams(max_new_tokens=n))
            for prompt, n in zip(prompts, lengths, strict=True)
        )
    )
    for prompt, n, result in zip(prompts, lengths, results, strict=True):
        expected = expected_greedy(model, prompt, n)
        assert result.token_ids == expected.token_ids, (prompt, n)
        assert result.finish_reason is expected.finish_reason
        assert result.prompt_tokens == len(prompt)
    assert any(result.outputs > 2 for result in results), "tokens are streamed, one per step"
    report = await engine.debug("pool")
    assert report["tiny"]["slots_held"] == 0  # type: ignore[index]
    produced = sum(len(result.token_ids) for result in results)
    assert registry.get_sample_value("steadyserve_output_tokens_total", labels) == (
        tokens_before + produced
    )
    assert registry.get_sample_value(
        "steadyserve_time_to_first_token_seconds_count", labels
    ) == firsts_before + len(results)
    engine.refresh_metrics()
    assert registry.get_sample_value("steadyserve_kv_cache_usage_ratio", labels) == 0
    # The cache preallocated at start-up served every sequence: nothing was reallocated.
    assert storage == [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]


async def test_a_sequence_that_does_not_stream_gets_one_output_with_every_token(
    engine: InProcessEngine, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    tokenizer, model = reference
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS[:8]]
    results = await asyncio.gather(
        *(
            generate(engine, prompt, SamplingParams(max_new_tokens=24), stream=False)
            for prompt in prompts
        )
    )
    for prompt, result in zip(prompts, results, strict=True):
        expected = expected_greedy(model, prompt, 24)
        assert result.outputs == 1
        assert result.token_ids == expected.token_ids, prompt
        assert result.finish_reason is expected.finish_reason
    assert {result.finish_reason for result in results} >= {FinishReason.LENGTH}


async def test_warm_up_ran_prefill_and_decode_shapes_before_ready(engine: InProcessEngine) -> None:
    status = engine.status()
    assert status is not None and status.state == "ready"
    # Prefill at the length buckets below the slot (16, 64) and its largest prompt (255);
    # decode at 1, 2, 4 and all 8 slots.
    assert status.warmup_total == 3 + 4
    assert status.warmup_done == status.warmup_total


async def test_max_new_tokens_ends_with_length(engine: InProcessEngine) -> None:
    result = await generate(engine, [1, 40, 41, 42], SamplingParams(max_new_tokens=5))
    assert result.finish_reason is FinishReason.LENGTH
    assert len(result.token_ids) == 5
    single = await generate(engine, [1, 40, 41, 42], SamplingParams(max_new_tokens=1))
    assert single.token_ids == result.token_ids[:1] and single.outputs == 1


async def test_oversized_request_is_refused_and_others_still_served(
    engine: InProcessEngine,
) -> None:
    prompt = list(range(10, 30))
    with pytest.raises(EngineRefused, match="generate_slot_tokens") as refused:
        await generate(engine, prompt, SamplingParams(max_new_tokens=SLOT_TOKENS))
    assert str(SLOT_TOKENS) in str(refused.value)
    fits = await generate(engine, prompt, SamplingParams(max_new_tokens=SLOT_TOKENS - len(prompt)))
    assert fits.finish_reason in (FinishReason.LENGTH, FinishReason.EOS)


async def test_seeded_sampling_repeats_and_top_k_one_is_greedy(engine: InProcessEngine) -> None:
    prompt = [1, 50, 60, 70, 80]
    sampled = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=7)
    first = await generate(engine, prompt, sampled)
    again = await generate(engine, prompt, sampled)
    assert first.token_ids == again.token_ids
    other_seed = SamplingParams(max_new_tokens=12, do_sample=True, temperature=1.5, seed=8)
    assert (await generate(engine, prompt, other_seed)).token_ids != first.token_ids
    greedy = await generate(engine, prompt, SamplingParams(max_new_tokens=12))
    top_one = SamplingParams(max_new_tokens=12, do_sample=True, top_k=1, seed=3)
    assert (await generate(engine, prompt, top_one)).token_ids == greedy.token_ids


async def test_a_full_cache_refuses_429_and_cancel_frees_it_at_once(tiny_causal_lm: Path) -> None:
    """One slot: while a long sequence holds it, a request needing the whole slot is refused
    429 with Retry-After (its wait is far over the 1 ms budget); once the long one is
    cancelled after its first token, its slot is free at once, while the multi-step run
    computing its row is still held in the model (so not at the run's end), and the same
    request is then admitted and completes."""
    engine = await started(
        settings_for(
            tiny_causal_lm,
            generate_slots=1,
            max_queue_delay_ms=1,
            # The cancel arrives while a long multi-step run computes the cancelled row.
            generate_steps_per_dispatch=64,
        )
    )
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    real_step = host.runner.step
    steps = 0
    in_the_run = threading.Event()  # the decode run after the prefill is in the model
    let_it_go = threading.Event()

    def held_after_the_prefill(rows: Sequence[StepRow]) -> list[int]:
        """Compute thread: the first step (the prefill) runs; the next waits for the test."""
        nonlocal steps
        steps += 1
        if steps > 1:
            in_the_run.set()
            let_it_go.wait(timeout=60)
        return real_step(rows)

    host.runner.step = held_after_the_prefill  # type: ignore[method-assign]
    try:
        prompt = [1, 40, 41, 42]
        request = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 120,
            GeneratePayload(prompt, SamplingParams(max_new_tokens=SLOT_TOKENS - len(prompt))),
        )
        whole_slot = SamplingParams(max_new_tokens=SLOT_TOKENS - 20)
        stream = engine.stream(request)
        await anext(stream)
        assert await asyncio.to_thread(in_the_run.wait, 60), "the decode run never started"
        with pytest.raises(Rejected) as refused:
            await generate(engine, list(range(10, 30)), whole_slot)
        assert refused.value.reason is RejectReason.QUEUE
        assert refused.value.retry_after_s is not None and refused.value.retry_after_s > 0
        await stream.aclose()  # the client went away: Cancel
        # The engine handles the Cancel in its next loop turns; the run stays in the model.
        # (In-process, `debug` can answer without a turn of the loop: Python 3.12's wait_for
        # takes a queued reply at once, so the loop gets its turns here.)
        for _ in range(1000):
            report = (await engine.debug("pool"))["tiny"]
            if report["slots_held"] == 0:  # type: ignore[index]
                break
            await asyncio.sleep(0)  # one turn of the loop, not a wait for time
        assert report["slots_held"] == 0, report  # type: ignore[index]
        assert not let_it_go.is_set()  # freed while its run was still computing
        let_it_go.set()
        whole = await generate(engine, list(range(10, 30)), whole_slot)
        assert len(whole.token_ids) == SLOT_TOKENS - 20 or whole.finish_reason is FinishReason.EOS
    finally:
        let_it_go.set()
        await engine.close()


@pytest.mark.parametrize("steps_per_dispatch", [1, 8])
async def test_eos_ends_the_sequence_without_the_token(
    tmp_path: Path, reference: tuple[AutoTokenizer, PreTrainedModel], steps_per_dispatch: int
) -> None:
    """A model whose EOS list holds a token greedy decoding reaches at step 6 (the
    generation config may name several): the engine stops there, as model.generate does,
    also when that step is inside a multi-step run (8 steps per dispatch), while the
    sequence decoding next to it goes on to its own end."""
    _, model = reference
    prompt, other = [1, 50, 60, 70], [1, 40, 41, 42]
    plain = expected_greedy(model, prompt, 10).token_ids
    stop = plain[5]
    assert stop not in plain[:5]
    beside = expected_greedy(model, other, 12).token_ids
    if stop in beside:
        beside = beside[: beside.index(stop)]
    assert len(beside) > 4, "the other sequence outlives the run that ends the first"
    directory = tiny_model_that_also_ends_at(tmp_path / "eos", stop)
    engine = await started(
        settings_for(directory, warmup=False, generate_steps_per_dispatch=steps_per_dispatch)
    )
    try:
        result, next_to_it = await asyncio.gather(
            generate(engine, prompt, SamplingParams(max_new_tokens=10)),
            generate(engine, other, SamplingParams(max_new_tokens=12)),
        )
    finally:
        await engine.close()
    assert result.token_ids == plain[:5]
    assert result.finish_reason is FinishReason.EOS
    assert next_to_it.token_ids == beside
    if steps_per_dispatch > 1:  # the last output is a run's tokens up to EOS
        assert result.sizes[-1] >= 2, result.sizes


def tiny_model_that_also_ends_at(directory: Path, stop: int) -> Path:
    """The tiny model with `stop` among its EOS tokens (a generation config may name
    several), written to `directory`."""
    build_tiny_causal_lm(directory)
    config_path = directory / "generation_config.json"
    config = json.loads(config_path.read_text())
    config["eos_token_id"] = [config["eos_token_id"], stop]
    config_path.write_text(json.dumps(config))
    return directory


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def started_on_clock(
    source: Path, clock: ManualClock
) -> tuple[InProcessEngine, GenerationHost]:
    """An engine (no warm-up) whose clock the test sets, and its generation host."""
    core = EngineCore(settings_for(source, warmup=False), Metrics(), clock=clock)
    engine = InProcessEngine(core)
    await engine.start()
    await engine.wait_ready()
    host = core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    return engine, host


async def test_a_deadline_passing_mid_sequence_fails_it_and_frees_its_slot(
    tiny_causal_lm: Path,
) -> None:
    clock = ManualClock()
    core = EngineCore(settings_for(tiny_causal_lm, warmup=False), Metrics(), clock=clock)
    engine = InProcessEngine(core)
    await engine.start()
    await engine.wait_ready()
    try:
        request = Submit(
            engine.next_request_id(),
            "tiny",
            clock.now + 10,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=200)),
        )
        received = 0
        with pytest.raises(DeadlineExceeded, match="after"):
            async for _ in engine.stream(request):
                received += 1
                clock.now += 20  # past the deadline before the next step
        assert 1 <= received < 200
        assert core.hosts["tiny"].debug_report()["slots_held"] == 0
    finally:
        await engine.close()


async def test_embedding_and_generation_models_side_by_side(tiny_causal_lm: Path) -> None:
    settings = settings_for(tiny_causal_lm, max_batch_size=4)  # warm-up measures costs
    settings = settings.model_copy(
        update={"models": (ModelSpec(name="minilm", task="embed"), *settings.models)}
    )
    engine = await started(settings)
    try:
        embed = Submit(
            engine.next_request_id(),
            "minilm",
            time.monotonic() + 60,
            EmbedPayload([[101, 7592, 102]]),
        )
        embedded, generated = await asyncio.gather(
            anext(engine.stream(embed)),
            generate(engine, [1, 40, 41, 42], SamplingParams(max_new_tokens=4)),
        )
        assert isinstance(embedded.payload, EmbedOutput) and embedded.payload.rows == 1
        assert len(generated.token_ids) == 4
        status = engine.status()
        assert status is not None
        # The embedding model's cost per input, not the generation host's 0, and the
        # compute its admission adds for a one-input batch of its smallest shape.
        assert status.seconds_per_input > 0
        shapes = (await engine.debug("pool"))["minilm"]["shapes"]  # type: ignore[index]
        one_input = next(s for s in shapes if (s["batch"], s["length"]) == (1, 16))
        assert status.least_own_compute_s * 1000 == pytest.approx(
            one_input["estimated_compute_ms"], abs=0.001
        )
        assert status.least_own_compute_s > 0
        assert {name: info.task for name, info in status.models.items()} == {
            "minilm": "embed",
            "tiny": "generate",
        }
        wrong = Submit(
            engine.next_request_id(), "tiny", time.monotonic() + 60, EmbedPayload([[1, 2]])
        )
        with pytest.raises(EngineRefused, match="generates text"):
            await anext(engine.stream(wrong))
    finally:
        await engine.close()


async def test_sequences_waiting_for_a_cache_slot_add_nothing_to_the_shared_backlog(
    tiny_causal_lm: Path,
) -> None:
    """Front ends shed every model's requests on the published backlog; a sequence waiting
    for a KV-cache slot delays only generate requests, so it must not show there."""
    engine = await started(settings_for(tiny_causal_lm, generate_slots=1))
    try:
        long = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 120,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=200)),
        )
        running = engine.stream(long)
        await anext(running)
        waiting = asyncio.create_task(
            generate(engine, [1, 50, 51], SamplingParams(max_new_tokens=3))
        )
        for _ in range(100):  # until the second request waits in the engine
            if engine.core.queued_inputs() == 1:
                break
            await asyncio.sleep(0)
        assert engine.core.queued_inputs() == 1
        status = engine.status()
        assert status is not None
        assert status.queued_inputs == 0  # front ends count these in embedding batches
        assert status.backlog_s == 0.0
        assert status.seconds_per_input == 0.0  # nor does each generate request sent
        assert status.least_own_compute_s == 0.0  # nor its admission, on top of the backlog
        await running.aclose()
        assert len((await waiting).token_ids) == 3
    finally:
        await engine.close()


async def test_multi_step_decoding_gives_the_tokens_of_single_steps(tiny_causal_lm: Path) -> None:
    """24 sequences (greedy and seeded sampling, different prompts and lengths) through 8
    slots, so sequences join, finish and wait: 5 decode steps per dispatch give every
    sequence exactly the tokens one step per dispatch gives, in fewer outputs."""
    prompts = [[1, *range(40 + i, 40 + i + 3 + i % 9)] for i in range(24)]
    samplings = [
        SamplingParams(max_new_tokens=6 + (i * 5) % 23)
        if i % 3
        else SamplingParams(
            max_new_tokens=9 + i, do_sample=True, temperature=1.3, top_k=40, top_p=0.9, seed=i
        )
        for i in range(24)
    ]
    results: dict[int, list[Generated]] = {}
    for steps in (1, 5):
        engine = await started(settings_for(tiny_causal_lm, generate_steps_per_dispatch=steps))
        try:
            results[steps] = await asyncio.gather(
                *(generate(engine, p, s) for p, s in zip(prompts, samplings, strict=True))
            )
            assert (await engine.debug("pool"))["tiny"]["slots_held"] == 0  # type: ignore[index]
        finally:
            await engine.close()
    for single, multi in zip(results[1], results[5], strict=True):
        assert multi.token_ids == single.token_ids
        assert multi.finish_reason is single.finish_reason
    assert all(size <= 1 for result in results[1] for size in result.sizes)
    assert any(size > 1 for result in results[5] for size in result.sizes), "runs happened"
    assert sum(r.outputs for r in results[5]) < sum(r.outputs for r in results[1])


async def test_an_arrival_interrupts_a_multi_step_run_and_joins(
    tiny_causal_lm: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """With 60 steps per dispatch, a request arriving while a run computes does not wait
    for it: the run stops after its current step, the newcomer is prefilled in the next
    dispatch, and both get model.generate's tokens."""
    _, model = reference
    first_prompt, second_prompt = [1, 50, 60, 70, 80], [1, 44, 45]
    first_expected = expected_greedy(model, first_prompt, 160)
    assert len(first_expected.token_ids) == 160, "no EOS: the runs are long"
    engine = await started(settings_for(tiny_causal_lm, generate_steps_per_dispatch=60))
    try:
        stream = engine.stream(submit(engine, first_prompt, SamplingParams(max_new_tokens=160)))
        head = [await anext(stream)]  # the prefill, a single step, then a 60-step run
        while len(head[-1].payload.token_ids) == 1:  # type: ignore[union-attr]
            head.append(await anext(stream))
        assert len(head[-1].payload.token_ids) == 60, len(head)  # type: ignore[union-attr]
        # The next run (up to 60 steps) computes now; this arrival must cut it short.
        second = asyncio.create_task(
            generate(engine, second_prompt, SamplingParams(max_new_tokens=10))
        )
        rest = await collect(stream)
        joined = await second
    finally:
        await engine.close()
    head_tokens = [t for o in head for t in o.payload.token_ids]  # type: ignore[union-attr]
    assert head_tokens + rest.token_ids == first_expected.token_ids
    assert rest.sizes[0] < 60, f"the run in flight went on to its end: {rest.sizes}"
    assert joined.token_ids == expected_greedy(model, second_prompt, 10).token_ids


async def test_a_loop_failing_between_steps_still_sends_the_last_steps_outputs(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last step's outputs wait while the next step starts; a loop that fails there
    (a bug) must still send them: those sequences are finished and removed, so nothing
    else would ever answer them."""
    engine = await started(settings_for(tiny_causal_lm))
    host = engine.core.hosts["tiny"]
    assert isinstance(host, GenerationHost)
    original = host._next_step
    failures = iter([RuntimeError("a bug between steps")])

    def fail_once_all_are_done() -> list[GenerationSequence]:
        if not host._batch.running and not host._batch.waiting and (error := next(failures, None)):
            raise error
        return original()

    monkeypatch.setattr(host, "_next_step", fail_once_all_are_done)
    engine.answer_grace_s = 0.0  # a lost answer fails at the deadline, not hangs
    try:
        request = Submit(
            engine.next_request_id(),
            "tiny",
            time.monotonic() + 30,
            GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=3)),
        )
        finished = await collect(engine.stream(request))
        assert finished.finish_reason is not None  # its final output arrived
        assert next(failures, None) is None  # the loop did fail after the last step
        again = await generate(engine, [1, 50, 51], SamplingParams(max_new_tokens=2))
        assert again.finish_reason is not None  # and was restarted
    finally:
        await engine.close()


async def yield_until(condition: object, what: str) -> None:
    """Yield to the event loop until `condition()` holds (bounded: fails, never hangs)."""
    for _ in range(1000):
        if callable(condition) and condition():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never happened: {what}")


async def test_a_cancel_read_in_the_same_turn_as_its_submit_drops_the_sequence(
    tiny_causal_lm: Path,
) -> None:
    """The engine reads a front end's Submit and Cancel in one turn when its loop was busy:
    the request's task is cancelled before it ever runs, and its sequence used to stay
    queued, then take a slot and generate for nobody."""
    engine = await started(settings_for(tiny_causal_lm, generate_slots=1))
    try:
        holder = engine.stream(submit(engine, [1, 40, 41], SamplingParams(max_new_tokens=200)))
        await anext(holder)  # the only slot is taken: the next request waits
        core, host = engine.core, engine.core.hosts["tiny"]
        request = submit(engine, [1, 50, 51], SamplingParams(max_new_tokens=3))
        core.submit(b"front", request, lambda message: None)
        assert host.queued_inputs() == 1
        core.cancel(b"front", request.request_id)  # same turn: its task has not run
        await yield_until(lambda: host.queued_inputs() == 0, "the cancelled sequence dropped")
        await holder.aclose()
    finally:
        await engine.close()


async def test_an_expiring_stream_gets_its_last_tokens_before_its_failure(
    tiny_causal_lm: Path,
) -> None:
    engine = await started(settings_for(tiny_causal_lm))
    try:
        host = engine.core.hosts["tiny"]
        assert isinstance(host, GenerationHost)
        received: list[object] = []
        request = submit(engine, [1, 50, 51], SamplingParams(max_new_tokens=3))
        engine.core.submit(b"front", request, received.append)
        [sequence] = [s for s in host._batch.waiting if s.request is request]
        pending = Output(request.request_id, False, TokensOutput([7], 3), 0.0, 0.0)
        host._outbox = [(sequence, pending)]  # the last step's, not sent yet
        host._expire(request.deadline + 1)
        assert [type(message).__name__ for message in received] == ["Output", "Failure"]
    finally:
        await engine.close()


async def test_a_sequence_without_a_client_set_limit_is_fitted_to_its_deadline(
    tiny_causal_lm: Path,
) -> None:
    """A request asking for its prompt's whole room used to be refused 504 whenever room x
    step time passed its deadline (every chat request without max_tokens on a slow model),
    although it might stop at EOS soon. Without a client-set limit it is admitted on one
    token's time and ends with `length` once the deadline's share of steps is spent."""
    clock = ManualClock()
    engine, host = await started_on_clock(tiny_causal_lm, clock)
    host._step_s = 1.0  # as if each step took a second
    room = SLOT_TOKENS - 3
    try:

        def request(fit: bool) -> Submit:
            sampling = SamplingParams(max_new_tokens=room, fit_to_deadline=fit)
            return Submit(
                engine.next_request_id(),
                "tiny",
                clock.now + 5.5,
                GeneratePayload([1, 40, 41], sampling),
            )

        with pytest.raises(Rejected) as refused:
            await collect(engine.stream(request(fit=False)))
        assert refused.value.reason is RejectReason.DEADLINE
        fitted = await collect(engine.stream(request(fit=True)))
        # 5.5 s x DEADLINE_FIT_SHARE at 1 s a step: 4 tokens (this prompt meets no EOS).
        assert (len(fitted.token_ids), fitted.finish_reason) == (4, FinishReason.LENGTH)
    finally:
        await engine.close()


async def test_a_dead_front_ends_sequences_free_their_slots_and_its_count_is_forgotten(
    tiny_causal_lm: Path,
) -> None:
    """A front end that dies sends no Cancel: its sequences kept their KV-cache slots and
    stepped on until their deadline. Told it is gone (`FrontEndGone`, by the supervisor),
    the engine drops them and forgets what that front end sent; other front ends' work
    goes on."""
    core = EngineCore(settings_for(tiny_causal_lm, warmup=False), Metrics())
    engine = InProcessEngine(core)
    await engine.start()
    await engine.wait_ready()
    dead, alive = frontend_identity(4242, 1), frontend_identity(4343, 1)
    outputs: dict[bytes, list[FromEngine]] = {dead: [], alive: []}
    first_output, alive_finished = asyncio.Event(), asyncio.Event()

    def emit_to(origin: bytes) -> Callable[[FromEngine], None]:
        def emit(message: FromEngine) -> None:
            outputs[origin].append(message)
            first_output.set()
            if origin == alive and isinstance(message, Output) and message.final:
                alive_finished.set()

        return emit

    try:
        for origin in (dead, alive):
            request = Submit(
                1,  # ids are unique per front end: the same id from two is two requests
                "tiny",
                time.monotonic() + 120,
                GeneratePayload([1, 40, 41], SamplingParams(max_new_tokens=SLOT_TOKENS - 4)),
            )
            core.submit(origin, request, emit_to(origin))
        await first_output.wait()
        host = core.hosts["tiny"]
        assert host.debug_report()["slots_held"] == 2
        assert set(core.status().taken_inputs) == {dead, alive}
        core.frontend_gone(4242)
        assert set(core.status().taken_inputs) == {alive}
        # Freed as its task's cancellation completes (the next turn of the loop).
        await yield_until(lambda: host.debug_report()["slots_held"] == 1, "the slot freed")
        emitted_to_the_dead = len(outputs[dead])
        # A Submit it sent before dying, read after the notice (the engine's socket takes
        # one message from each peer in turn): dropped, uncounted, unanswered.
        late = Submit(
            2, "tiny", time.monotonic() + 120, GeneratePayload([1, 40], SamplingParams(4))
        )
        core.submit(dead, late, emit_to(dead))
        assert set(core.status().taken_inputs) == {alive}
        assert host.debug_report()["slots_held"] == 1
        await asyncio.wait_for(alive_finished.wait(), 60)  # the other goes on to its end
        assert len(outputs[dead]) == emitted_to_the_dead
    finally:
        await engine.close()


async def test_the_step_time_estimate_comes_from_a_warm_step_of_every_slot(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first step of a shape pays its set-up: seeding the estimate (which admission and
    the deadline fit divide by) from that cold step overstated it until traffic smoothed it."""
    steps: list[int] = []
    original = CausalLMRunner.step

    def counted(self: CausalLMRunner, rows: list[StepRow]) -> list[int]:
        steps.append(len(rows))
        if steps.count(SLOTS) == 1:  # the first all-slot step: cold, as a new shape's is
            time.sleep(0.3)
        return original(self, rows)

    monkeypatch.setattr(CausalLMRunner, "step", counted)
    engine = await started(settings_for(tiny_causal_lm))
    try:
        # Decode at 1, 2, 4 and all 8 slots, then all 8 again: the estimate's step.
        assert steps[-5:] == [1, 2, 4, SLOTS, SLOTS]
        host = engine.core.hosts["tiny"]
        assert isinstance(host, GenerationHost)
        # Seeded from the warm all-slot step (milliseconds), not the cold one (300+ ms).
        assert host.debug_report()["step_ms"] < 150
    finally:
        await engine.close()


async def test_a_fitted_sequence_short_of_time_ends_with_length_not_a_504(
    tiny_causal_lm: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its cap is planned from the compute time of a step; a token really takes longer (the
    loop's turn between steps), so it reached its deadline before its cap and was failed
    504, its whole answer lost. It now ends with `length` once another step would not fit."""
    clock = ManualClock()
    engine, host = await started_on_clock(tiny_causal_lm, clock)
    host._step_s = 1.0
    # Held at 1 s: measured steps (milliseconds) would otherwise smooth it away, and whether
    # the half second left below still fits a step would depend on how many ran.
    monkeypatch.setattr(host, "_record_step", lambda result: None)
    deadline = clock.now + 40.0  # a cap of 36 tokens at 1 s a step
    sampling = SamplingParams(max_new_tokens=SLOT_TOKENS - 4, fit_to_deadline=True)
    request = Submit(engine.next_request_id(), "tiny", deadline, GeneratePayload([1, 40], sampling))
    try:
        outputs = []
        async for output in engine.stream(request):
            outputs.append(output)
            if len(outputs) == 2:
                clock.now = deadline - 0.5  # steps took longer than planned
        final = outputs[-1].payload
        assert isinstance(final, TokensOutput) and final.finish_reason is FinishReason.LENGTH
        assert 2 <= sum(len(o.payload.token_ids) for o in outputs) < 36
        assert host.debug_report()["slots_held"] == 0
    finally:
        await engine.close()


async def test_a_multi_step_run_ends_when_a_row_ends_at_eos_and_a_sequence_waits(
    tmp_path: Path, reference: tuple[AutoTokenizer, PreTrainedModel]
) -> None:
    """A row leaving the run at EOS frees its slot only when the run ends: the waiting
    sequence sat up to k-1 forwards longer while the batch ran a row short."""
    _, model = reference
    prompt, other, waiting = [1, 50, 60, 70], [1, 40, 41, 42], [1, 44, 45]
    plain = expected_greedy(model, prompt, 10).token_ids
    stop = plain[5]
    beside = expected_greedy(model, other, 12).token_ids
    assert stop not in plain[:5] and stop not in beside, "the premise: only the first stops"
    directory = tiny_model_that_also_ends_at(tmp_path / "eos", stop)
    engine = await started(
        settings_for(directory, warmup=False, generate_steps_per_dispatch=8, generate_slots=2)
    )
    try:
        first, second, third = await asyncio.gather(
            generate(engine, prompt, SamplingParams(max_new_tokens=10)),
            generate(engine, other, SamplingParams(max_new_tokens=12)),
            generate(engine, waiting, SamplingParams(max_new_tokens=4)),
        )
    finally:
        await engine.close()
    assert first.finish_reason is FinishReason.EOS and first.token_ids == plain[:5]
    assert second.token_ids == beside
    # The prefill, then a run cut at the step the first sequence chose EOS (its 5th
    # decode step), not one of 8 steps.
    assert second.sizes[:2] == (1, 5), second.sizes
    assert third.token_ids == expected_greedy(model, waiting, 4).token_ids
