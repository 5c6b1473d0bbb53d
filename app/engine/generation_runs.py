"""A multi-step decode run on a compute thread (`StepRunner.start` with `steps` > 1): each
step feeds every row the token it just chose, with no turn of the event loop between steps,
and hands its tokens over as it ends; and the generator states a failed step puts back.
Compute threads only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from app.models.causal_lm import CausalLMRunner, StepRow
from app.models.sampling import NO_TOKEN

# A step's rows (by slot), their chosen tokens and whether the run goes on: from the compute
# thread to a `StepListener` on the event loop thread (`StepRunner.start`).
HandOver = Callable[[list[int], list[list[int]], bool], None]


def drawing(rows: Sequence[StepRow]) -> Callable[[], None]:
    """Compute thread, as a step starts: what puts its sampled rows' generators back as
    they are now (greedy rows draw nothing). A rerun of the step's rows must draw as it
    would have, else a seeded sample depends on a failure."""
    kept = [(row.generator, row.generator.get_state()) for row in rows if row.sampling.do_sample]

    def put_back() -> None:
        for generator, state in kept:
            generator.set_state(state)

    return put_back


def decode_run(
    runner: CausalLMRunner,
    rows: Sequence[StepRow],
    steps: int,
    hand_over: HandOver,
    each_step: frozenset[int],
    interrupted: threading.Event,
    end_on_eos: threading.Event,
    stepped: Callable[[], None] = lambda: None,
) -> int:
    """Up to `steps` decode steps, each feeding every row the token it just chose (the
    same rows, positions and generator draws as single steps); a row that chose EOS or
    one of its `stop_token_ids` (or got `NO_TOKEN`: its logits broke down) stops, as
    does the run once `interrupted` is set, or, while `end_on_eos` is set (a sequence
    waits for a slot), after the step in which any row chose EOS. The tokens of the rows
    in `each_step`'s slots go to `hand_over` as each step ends (their clients see each
    token as it is made); the others' as the run ends, as the row leaves it (its sequence
    ends then), or before a failed step raises (what was computed is kept). `stepped()` is
    called as each step ends. Returns the steps run."""
    eos = runner.eos_token_ids
    active = sorted(rows, key=lambda row: row.slot)  # slot order: see `StepRunner._forwards`
    held: dict[int, list[int]] = {}  # by slot: tokens of rows not in `each_step`
    for step in range(1, steps + 1):
        put_back = drawing(active)
        try:
            chosen = runner.step(active)
        except BaseException:
            put_back()
            if held:
                hand_over(list(held), list(held.values()), False)
            raise
        following: list[StepRow] = []
        now_slots: list[int] = []
        now_tokens: list[list[int]] = []
        for row, token in zip(active, chosen, strict=True):
            ends = token in eos or token in row.sampling.stop_token_ids
            leaves = ends or token == NO_TOKEN
            if row.slot in each_step:
                now_slots.append(row.slot)
                now_tokens.append([token])
            else:
                held.setdefault(row.slot, []).append(token)
                if leaves:  # its sequence ends now: its answer waits for no later step
                    now_slots.append(row.slot)
                    now_tokens.append(held.pop(row.slot))
            if not leaves:
                following.append(
                    StepRow(
                        row.slot,
                        (token,),
                        row.start + 1,
                        row.sampling,
                        row.generator,
                        row.logprobs,
                    )
                )
        ended = len(following) < len(active) and end_on_eos.is_set()
        going_on = bool(following) and step < steps and not ended
        going_on = going_on and not interrupted.is_set()
        if not going_on:
            now_slots.extend(held)
            now_tokens.extend(held.values())
        stepped()  # before its tokens go over: a held row's are counted either way
        if now_slots:
            hand_over(now_slots, now_tokens, going_on)
        if not going_on:
            return step
        active = following
    return steps
