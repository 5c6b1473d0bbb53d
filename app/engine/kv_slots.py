"""Pure policy of the generation task's KV cache: whether a request can ever fit, and how
long a new sequence would wait for a slot (which slots are free and what each holds:
`slot_table.py`).

No torch, no asyncio, no clock: the generation host (event loop thread) calls these with its
own numbers, and unit tests call them directly.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import msgspec

from app.admission import DelayEstimate, Rejected, RejectReason, delay_verdict
from app.engine.protocol import GeneratePayload, SamplingParams
from app.engine.protocol_logprobs import MAX_TOP_LOGPROBS
from app.model_queues import ModelWork


class SequenceLimits(Protocol):
    """What a generate model's runner holds one sequence to."""

    @property
    def max_sequence_tokens(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...


def payload_problem(payload: GeneratePayload, limits: SequenceLimits) -> str | None:
    """Why the request can never be served (a 400, naming the limit), or None."""
    prompt = len(payload.prompt_ids)
    sampling = payload.sampling
    max_sequence_tokens = limits.max_sequence_tokens
    if prompt == 0:
        return "the prompt has no tokens"
    # An id past the embedding is an IndexError on the CPU, a device-side assert on CUDA
    # (the device lost: every request in the engine failed); front ends check it too.
    if min(payload.prompt_ids) < 0 or max(payload.prompt_ids) >= limits.vocab_size:
        return f"a prompt token id is outside the model's ids (0 to {limits.vocab_size - 1})"
    if sampling.max_new_tokens < 1:
        return f"max_new_tokens must be at least 1 (got {sampling.max_new_tokens})"
    if sampling.do_sample and sampling.temperature <= 0:
        return f"temperature must be positive when sampling (got {sampling.temperature})"
    if not 0 <= sampling.top_p <= 1:
        return f"top_p must be in [0, 1] (got {sampling.top_p})"
    if sampling.top_k < 0:
        return f"top_k must not be negative (got {sampling.top_k})"
    if sampling.logprobs is not None and not 0 <= sampling.logprobs <= MAX_TOP_LOGPROBS:
        return f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {sampling.logprobs})"
    if (
        sampling.prompt_logprobs is not None
        and not 0 <= sampling.prompt_logprobs <= MAX_TOP_LOGPROBS
    ):
        return (
            f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}] (got {sampling.prompt_logprobs})"
        )
    total = prompt + sampling.max_new_tokens
    if total > max_sequence_tokens:
        return (
            f"prompt ({prompt} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {total} "
            f"exceeds the {max_sequence_tokens} tokens one sequence may hold in the KV cache "
            "(generate_slot_tokens)"
        )
    return None


def steps_until_start(
    running_remaining: Iterable[int], free_slots: int, waiting_new_tokens: Iterable[int]
) -> int:
    """Decode steps before a sequence queued now gets a slot: the sequences already waiting
    take slots first, each as the running sequence with the fewest tokens left finishes
    (running_remaining: tokens each still has to produce; waiting_new_tokens: each waiting
    sequence's max_new_tokens, in queue order). 0 when a slot is free for it."""
    finishes = list(running_remaining)
    heapq.heapify(finishes)
    free = free_slots
    for new_tokens in waiting_new_tokens:
        if free > 0:
            free -= 1
            heapq.heappush(finishes, new_tokens)
            continue
        if not finishes:
            return 0
        start = heapq.heappop(finishes)
        heapq.heappush(finishes, start + new_tokens)
    if free > 0 or not finishes:
        return 0
    return finishes[0]


def prefill_steps(prompt_tokens: int, chunk_tokens: int) -> int:
    """Steps `prompt_tokens` still to prefill take before the one choosing the first token:
    a waiting request's whole prompt (one joining may reuse some in its slot, but which
    slot it takes is not known), a running sequence's rest (`GenerationSequence`)."""
    return max(0, -(-prompt_tokens // chunk_tokens) - 1)


# Of the time a deadline leaves after the wait for a slot, the share a sequence without a
# client-set limit plans to generate in: steps vary around the average the plan divides by.
DEADLINE_FIT_SHARE = 0.9


@dataclass(frozen=True, slots=True)
class StepPrice:
    """What a sequence's steps cost in time once it runs: `step_s` of its own compute each,
    and, for each step, a turn of every other model with work (`turn_s`: their next
    batches, divided among the compute slots, as `model_queues` counts them: another model
    in line ends a multi-step run after its current step, `ComputeSlots.on_claim`), those
    turns `turns_s` in all at most (the other models' work beyond what the sequence's wait
    already counted)."""

    step_s: float
    turn_s: float = 0.0
    turns_s: float = 0.0

    def seconds(self, tokens: int, prefill_steps: int = 0) -> float:
        """The time `tokens` decode steps take, after `prefill_steps` prompt chunks' steps."""
        steps = tokens + prefill_steps
        return steps * self.step_s + min(steps * self.turn_s, self.turns_s)

    def tokens_within(self, seconds: float, room: int, prefill_steps: int = 0) -> int:
        """The most decode steps (at most `room`) that, after `prefill_steps` prompt chunks'
        steps, take no more than `seconds` (`seconds`, whose turns' cap counts both once);
        `room` while no step time is known yet."""
        if self.step_s <= 0 or seconds <= 0:
            return room if self.step_s <= 0 else 0
        low, high = 0, min(room, int(seconds / self.step_s))  # steps alone: an upper bound
        while low < high:  # `seconds` grows with the steps: the largest that fits
            middle = (low + high + 1) // 2
            if self.seconds(middle, prefill_steps) <= seconds:
                low = middle
            else:
                high = middle - 1
        return low


def step_price(
    model: str,
    works: Mapping[str, ModelWork] | None,
    workers: int,
    step_s: float,
) -> StepPrice:
    """`model`'s steps priced with the other models' turns between them, from every model's
    work as admission saw it (`works`; None: steps alone): each other model with work takes
    a turn before each step, for its turns left after those the wait counted
    (`model_queues.wait_ahead`: before each of `model`'s steps ahead, and one more)."""
    if not works:
        return StepPrice(step_s)
    own = works.get(model)
    counted = own.batches_ahead + 1 if own is not None else 1
    others = [w for name, w in works.items() if name != model and w.turns > 0]
    return StepPrice(
        step_s,
        turn_s=sum(w.next_batch_s for w in others) / workers,
        turns_s=sum(max(0, w.turns - counted) * w.next_batch_s for w in others) / workers,
    )


def tokens_within(
    time_left_s: float, wait_s: float, price: StepPrice, room: int, prefill_steps: int = 0
) -> int:
    """New tokens (at most `room`) a sequence starting after `wait_s` can generate within
    `DEADLINE_FIT_SHARE` of `time_left_s`, after `prefill_steps` prompt chunks' steps, its
    steps priced at `price`."""
    budget = (time_left_s - wait_s) * DEADLINE_FIT_SHARE
    return price.tokens_within(budget, room, prefill_steps)


def fitted_sampling(
    sampling: SamplingParams,
    time_left_s: float,
    wait_s: float,
    price: StepPrice,
    prefill_steps: int = 0,
) -> SamplingParams:
    """`sampling`, its `max_new_tokens` lowered to what the deadline leaves time for when the
    client set no limit (`fit_to_deadline`; at least one token), its prompt's extra chunk
    steps (`prefill_steps`) first."""
    if not sampling.fit_to_deadline:
        return sampling
    room = sampling.max_new_tokens
    fitted = tokens_within(time_left_s, wait_s, price, room, prefill_steps)
    return msgspec.structs.replace(sampling, max_new_tokens=max(1, fitted))


def start_verdict(
    wait_s: float, generate_s: float, deadline: float, now: float, max_queue_delay_s: float
) -> Rejected | None:
    """None to admit a sequence that starts after `wait_s` (for a slot) and then generates
    for `generate_s`. The queue-delay budget bounds the wait alone (a long generation is not
    a long queue); the deadline must hold the wait and the generation (504 otherwise)."""
    time_left = deadline - now
    if wait_s + generate_s >= time_left:
        return Rejected(
            RejectReason.DEADLINE,
            f"the deadline leaves {max(0.0, time_left) * 1000:.0f} ms, less than the predicted "
            f"{wait_s * 1000:.0f} ms wait for a KV-cache slot and "
            f"{generate_s * 1000:.0f} ms of generation",
        )
    return delay_verdict(DelayEstimate(wait_s, 0.0), deadline, now, max_queue_delay_s)
