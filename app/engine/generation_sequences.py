"""One generate request's sequence in the engine: its prompt, sampling, the tokens it has
generated, its KV-cache slot once it joined the running batch, and the `Output` messages
it streams (the last one `final`). Event loop thread only; its generator is used by the
step that computes it, one step at a time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import torch

from app.engine.host import Emit, RequestTracer
from app.engine.kv_slots import prefill_steps
from app.engine.protocol import FinishReason, Output, SamplingParams, Submit, TokensOutput
from app.engine.protocol_logprobs import EndToken, TokenLogprobs
from app.models.causal_lm import StepRow
from app.models.logprobs import LogprobSink


@dataclass(eq=False)
class GenerationSequence:
    request: Submit
    prompt: list[int]
    sampling: SamplingParams
    streams: bool  # False: only its final output is sent, with every token
    emit: Emit
    generator: torch.Generator
    arrived: float
    done: asyncio.Future[None]
    arrival_trace: object | None
    # The most prompt tokens one step prefills (`generate_prefill_chunk_tokens`): a longer
    # prompt is prefilled a chunk a step, `prefilled` counting those in its slot.
    chunk_tokens: int = 1 << 30
    prefilled: int = 0
    reused: int = 0  # of `prefilled`, found resident in its slot at join, until counted
    slot: int | None = None
    started: float | None = None  # joined the batch
    first_token_at: float | None = None
    last_token_at: float | None = None  # when its last kept token was made (not EOS)
    last_output_at: float | None = None  # when its previous output was made
    generated: list[int] = field(default_factory=list)
    # Asked for (`sampling.logprobs`): where each step puts its token's log probabilities,
    # by position, and those of `generated` not sent yet (all, unless it streams), one
    # each, taken from it as they are kept.
    logprob_sink: LogprobSink | None = None
    token_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Asked for (`sampling.prompt_logprobs`): prompt tokens 1..L-1's, taken from the sink
    # after the prefill, until its first output sent carries them (then None again).
    prompt_logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs_sent: bool = False
    # The token that ended it at EOS (or a stop token id), not kept, with its log
    # probabilities (`sampling.logprobs`): sent with its final output (`TokensOutput.end`).
    end_token: EndToken | None = None
    chose_end: bool = False  # a step chose its ending token (EOS, a stop id): never fed

    def __post_init__(self) -> None:
        if self.sampling.logprobs is not None or self.sampling.prompt_logprobs is not None:
            self.logprob_sink = {}

    def _prefilled(self) -> bool:
        """Its prefill (its last chunk) just ran: its first `take` (the host takes no
        tokens after a non-final chunk, which has none)."""
        fresh = not self.generated and not self.prompt_logprobs_sent
        return fresh and self.prompt_logprobs is None

    @property
    def prefilling(self) -> bool:
        """Part of its prompt is not in its slot yet: its next row is a prompt chunk."""
        return self.prefilled < len(self.prompt)

    def next_chunk(self) -> int:
        """Prompt tokens its next row feeds (0 once prefilled)."""
        return min(self.chunk_tokens, len(self.prompt) - self.prefilled)

    def chunk_computed(self) -> int:
        """Its row's step ran: a prompt chunk is now in its slot (none for a decode row).
        Returns the prompt tokens it found resident in its slot at join (`reused`), once,
        after its first step: those served it only if that step ran."""
        counted, self.reused = self.reused, 0
        self.prefilled += self.next_chunk()
        return counted

    def prefill_steps(self) -> int:
        """Steps before the one that chooses its first token: its prompt's chunks but the
        last (which chooses it)."""
        return prefill_steps(len(self.prompt) - self.prefilled, self.chunk_tokens)

    def resident(self) -> tuple[int, ...]:
        """The tokens whose keys and values its taken steps wrote in its slot (positions
        0..n-1): its prompt's computed chunks (those reused included), then the tokens its
        decode rows fed: each kept token but the last, which only an ending token's step
        fed (the ending token itself never is)."""
        if self.prefilling:
            return tuple(self.prompt[: self.prefilled])
        fed = len(self.generated) - 1 + self.chose_end
        return (*self.prompt, *self.generated[: max(fed, 0)])

    def resident_after(self, chosen: list[int]) -> tuple[int, ...]:
        """`resident` once its row of a step that chose `chosen` for it has run, the step
        having run on after it left (its tokens are never taken): its chunk; or its last
        token and each one the row chose but the last (a multi-step run feeds each chosen
        token to the next step, and a row stops at its ending token)."""
        if self.prefilling:
            return tuple(self.prompt[: self.prefilled + self.next_chunk()])
        return (*self.prompt, *self.generated, *chosen[:-1])

    @property
    def remaining(self) -> int:
        return self.sampling.max_new_tokens - len(self.generated)

    def steps_left(self) -> int:
        """Steps until it reaches its length: its tokens left and its prefill's extra
        chunks (`prefill_steps`)."""
        return self.remaining + self.prefill_steps()

    def take(self, chosen: list[int], eos: frozenset[int]) -> tuple[list[int], FinishReason | None]:
        """Add the tokens a step (or a multi-step run) chose for it, up to EOS or one of its
        `stop_token_ids` (either ends it as EOS, not kept: with `logprobs`, it and its log
        probabilities go to `end_token`) or its length; returns those kept and why it
        ended, if it did."""
        fresh: list[int] = []
        finish: FinishReason | None = None
        ending: int | None = None
        stop_ids = self.sampling.stop_token_ids
        for token in chosen:
            if token in eos or token in stop_ids:
                finish, ending = FinishReason.EOS, token
                self.chose_end = True
                break
            fresh.append(token)
            if len(fresh) >= self.remaining:  # `generated` is extended below
                finish = FinishReason.LENGTH
                break
        sink = self.logprob_sink
        if sink is not None and self.sampling.prompt_logprobs is not None and self._prefilled():
            # After the prefill: the prompt's, out of the sink (which then holds no more
            # than a step's tokens); a prefill that broke down (NO_TOKEN) may lack them.
            taken = [sink.pop(p, None) for p in range(1, len(self.prompt))]
            self.prompt_logprobs = [t for t in taken if t is not None]
        if sink is not None and self.sampling.logprobs is not None:
            first = len(self.prompt) + len(self.generated)
            self.token_logprobs.extend(sink.pop(first + i) for i in range(len(fresh)))
            # The ending token's, at the position after the kept ones (the step that chose
            # it wrote them there, as for any token).
            ended = sink.pop(first + len(fresh), None) if ending is not None else None
            if ending is not None and ended is not None:
                self.end_token = EndToken(ending, ended)
        self.generated.extend(fresh)
        return fresh, finish

    def deadline_end(self, now: float, step_s: float) -> Literal["length", "failed"] | None:
        """How its deadline ends it now, if it does: "length" for a sequence whose client set
        no limit (`fit_to_deadline`) and that has tokens, once another step (`step_s`) would
        pass its deadline; "failed" for any other past its deadline (a 504). Its
        fitted cap is planned from a step's compute, and the loop's turn makes a token take
        longer: it reached its deadline before its cap, and its whole answer was lost."""
        deadline = self.request.deadline
        if self.sampling.fit_to_deadline and self.generated and deadline <= now + step_s:
            return "length"
        return "failed" if deadline <= now else None

    def time_per_output_token(self) -> float | None:
        """Mean seconds between its generated tokens, once it has two: from its first to
        its last kept one, not to the step that chose EOS (not kept) nor to the deadline
        check that ended it, which would stretch its `produced - 1` intervals."""
        produced = len(self.generated)
        if produced < 2 or self.first_token_at is None or self.last_token_at is None:
            return None
        return (self.last_token_at - self.first_token_at) / (produced - 1)

    def row(self) -> StepRow:
        """Its part of the next step: its prompt's next chunk at its positions (the chunk
        that ends the prompt chooses its first token; one before it names the token after
        it instead: `StepRow.next_prompt_token`), or its last token at its position. A step
        run again (a failed step's triage) gets the same row: `prefilled` moves on only
        when its step's tokens are taken (`chunk_computed`)."""
        assert self.slot is not None
        sink = self.logprob_sink
        if self.prefilling:
            start = self.prefilled
            end = start + self.next_chunk()
            following = self.prompt[end] if end < len(self.prompt) else None
            chunk = self.prompt if start == 0 and following is None else self.prompt[start:end]
            return StepRow(
                self.slot, chunk, start, self.sampling, self.generator, sink, True, following
            )
        position = len(self.prompt) + len(self.generated) - 1
        fed = self.generated[-1:]
        return StepRow(self.slot, fed, position, self.sampling, self.generator, sink)

    def output(
        self,
        token_ids: list[int],
        finish: FinishReason | None,
        now: float,
        tracer: RequestTracer,
    ) -> Output:
        """Its next output message: `token_ids` (the last of `generated`: their log
        probabilities too, when asked), and with `finish` its last (traced). Its compute is
        the time since the previous output (since it joined the batch, for the first), so a
        front end that sums its outputs' compute counts each step once."""
        started = self.started if self.started is not None else now
        since = self.last_output_at if self.last_output_at is not None else started
        self.last_output_at = now
        final = finish is not None
        logprobs = prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
            self.prompt_logprobs_sent = True
        if self.sampling.logprobs is not None:
            logprobs = self.token_logprobs[len(self.token_logprobs) - len(token_ids) :]
            if self.streams:  # sent: no later output sends them again
                self.token_logprobs = []
        end = self.end_token if final else None
        return Output(
            self.request.request_id,
            final=final,
            payload=TokensOutput(
                token_ids, len(self.prompt), finish, logprobs, prompt_logprobs, end
            ),
            queue_s=started - self.arrived,
            compute_s=now - since,
            trace=tracer.finish(self.arrival_trace, None) if final else None,
        )


def steps_for(
    sequences: Iterable[GenerationSequence],
    per_dispatch: int,
    now: float = 0.0,
    step_s: float = 0.0,
) -> int:
    """Decode steps the next dispatch may run: one while a sequence prefills (a chunk of its
    prompt); else up to `per_dispatch`, and no step past the one at which a sequence reaches
    its length (its slot then frees for a waiting one, as with single steps), nor, at
    `step_s` a step from `now`, past the deadline of one that does not stream (its tokens
    are taken, and its deadline checked, only as the run ends: a whole run late, its 504
    came after the proxy's own timeout)."""
    steps = per_dispatch
    for sequence in sequences:
        if sequence.prefilling:
            return 1
        steps = min(steps, sequence.remaining)
        if not sequence.streams and step_s > 0:
            steps = min(steps, int((sequence.request.deadline - now) / step_s))
    return max(steps, 1)
