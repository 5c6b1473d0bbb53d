"""Generation behind the routes: check sizes -> tokenize (chat template applied) -> admit
by tokens -> one engine request per sequence (`n` per prompt) -> detokenize each stream
incrementally, cut at stop strings -> text pieces and one end per sequence.

Admission is the `Service`'s (draining, readiness, deadline, token bucket, in-flight cap):
a request is charged, for each of its sequences, its prompt's tokens plus the tokens it may
generate, what it can hold of the engine's cache. `prepare` does everything that can refuse
a request before an answer starts (so a streamed answer can still be a plain 4xx/429);
`stream` then runs the sequences. Leaving `stream` early (a stop string, a client gone, a
cancelled task) cancels the engine requests, which frees their cache. Front-end event loop
thread only.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from app.engine.client import EngineUnavailable
from app.engine.protocol import FinishReason, GeneratePayload, SamplingParams, Submit, TokensOutput
from app.generation.detokenize import IncrementalDetokenizer, WholeText
from app.generation.echo import PromptEchoes, echoed
from app.generation.errors import (
    ContextTooLong,
    NoChatTemplate,
    PromptTooManyCharacters,
    TokenIdOutOfVocabulary,
    TooManyTokens,
)
from app.generation.events import (
    GenerationEvent,
    OpenAIFinish,
    SequenceEnd,
    TextPiece,
    decoded,
    last_events,
)
from app.generation.logprobs import LogprobAligner, carried
from app.generation.merge import merge
from app.generation.seeds import sequence_seed
from app.generation.stops import StopMatcher
from app.generation.tokenizer import GenerationTokenizer
from app.service import MAX_CHARS_PER_TOKEN, Service, WrongTask
from app.timing import PhaseTimer

# OpenAI's definitions: "stop" for a natural end (EOS) or a stop string, "length" for
# max_tokens reached.
_FINISH: dict[FinishReason, OpenAIFinish] = {
    FinishReason.EOS: "stop",
    FinishReason.LENGTH: "length",
}


@dataclass(frozen=True, slots=True)
class Sampling:
    """How every sequence of a request continues; `max_new_tokens` None: all the room its
    prompt leaves in a sequence (0: none, only with `echo`); `logprobs` set: each token's
    log probabilities and this many alternatives' (`SamplingParams.logprobs`); `echo`: each
    sequence's text begins with its prompt's, and with `prompt_logprobs` set, its log
    probabilities with the prompt tokens' (`echo.py`); `logprobs_end`: a sequence ending at
    EOS (or a stop token id) lists that token last in its log probabilities, not in its text
    (completions', as OpenAI's legacy API and vLLM; chat and /infer list only text tokens)."""

    max_new_tokens: int | None
    do_sample: bool
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stops: tuple[str, ...]
    logprobs: int | None = None
    echo: bool = False
    prompt_logprobs: int | None = None
    logprobs_end: bool = False


@dataclass(frozen=True, slots=True)
class PreparedGeneration:
    """An admitted request: its prompts' token ids and the new tokens each may take;
    `stop_token_ids`: the ids of its stop strings that are special tokens' texts; `n`: the
    independent sequences (choices) each prompt gets."""

    model: str
    prompt_ids: tuple[list[int], ...]
    new_tokens: tuple[int, ...]
    sampling: Sampling
    stop_token_ids: tuple[int, ...]
    deadline: float
    arrived_at: float
    n: int = 1

    @property
    def sequences(self) -> int:
        """How many sequences it runs: `n` per prompt, sequence i * n + j being prompt i's
        choice j (OpenAI's order of a completion's choices)."""
        return len(self.prompt_ids) * self.n


@dataclass(slots=True)
class _SequenceTime:
    """What one sequence spent in the engine, from its outputs: waiting before it joined the
    running batch, then computing (each output's compute covers the time since the previous
    one)."""

    queue_s: float = 0.0
    compute_s: float = 0.0


class TextGeneration:
    def __init__(self, service: Service) -> None:
        self.service = service

    def tokenizer(self, model: str) -> GenerationTokenizer:
        """The model's tokenizer; raises `WrongTask` for a model of another task."""
        task = self.service.model_task(model)
        tokenizer = self.service.tokenizers.get(model)
        if task != "generate" or not isinstance(tokenizer, GenerationTokenizer):
            raise WrongTask(model, task, "generate")
        return tokenizer

    def chat_prompt(
        self, model: str, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text of a conversation; raises `NoChatTemplate`, or `ChatTemplateError`
        when the template refuses the messages."""
        template = self.tokenizer(model).chat_template
        if template is None:
            raise NoChatTemplate(model)
        return template.render(messages, add_generation_prompt)

    def context_limit(self, model: str) -> int:
        """The most tokens one sequence may hold: the model's own limit and the engine's."""
        limit = self.tokenizer(model).max_input_tokens
        info = self.service.model_info(model)
        if info is None:
            return limit
        # The engine publishes its longest prompt: one that leaves room for a new token.
        return min(limit, info.max_input_tokens + 1)

    async def prepare(
        self,
        model: str,
        prompts: Sequence[str | list[int]],
        sampling: Sampling,
        *,
        templated: bool,
        timeout_ms: float | None,
        envoy_timeout_ms: float | None,
        timer: PhaseTimer,
        n: int = 1,
    ) -> PreparedGeneration:
        """Check, tokenize and admit. A prompt is a text or its token ids (checked against the
        vocabulary, not tokenized; limited and charged as a text's). `templated`: the prompts
        come from a chat template, which writes its special tokens itself; `n`: sequences per
        prompt, each charged (the engine holds every one's prompt and new tokens). Raises
        `WrongTask`, `StopHoldsSpecialToken`, `TokenIdOutOfVocabulary`, `ContextTooLong` (a
        prompt over the sequence's limit, in tokens or, before any tokenizer pass, in
        characters), `TooManyTokens` or `Rejected` (429/503/504)."""
        tokenizer = self.tokenizer(model)
        now, deadline = self.service.begin(model, timeout_ms, envoy_timeout_ms)
        stop_token_ids = tokenizer.stop_token_ids(sampling.stops)  # a special token's text
        limit = self.context_limit(model)
        max_chars = limit * MAX_CHARS_PER_TOKEN
        for index, prompt in enumerate(prompts):  # before any tokenizer pass
            if isinstance(prompt, str) and len(prompt) > max_chars:
                raise PromptTooManyCharacters(index, len(prompt), max_chars, limit)
            if not isinstance(prompt, str):
                check_vocabulary(index, prompt, self._vocabulary(model, tokenizer))
        texts = [prompt for prompt in prompts if isinstance(prompt, str)]
        chars = sum(len(text) for text in texts)
        encoded = iter(
            await self.service.run_tokenizer(
                chars, timer, _encode_all, tokenizer, texts, not templated
            )
            if texts
            else []
        )
        prompt_ids = [next(encoded) if isinstance(p, str) else list(p) for p in prompts]
        tokenized_at = self.service.clock()
        timer.add("tokenize", tokenized_at - now)
        new_tokens = []
        for index, ids in enumerate(prompt_ids):
            room = limit - len(ids)
            wanted = sampling.max_new_tokens if sampling.max_new_tokens is not None else room
            if wanted > room or room < 1:
                echo_only = sampling.max_new_tokens == 0  # asks for none: `wanted`, 0
                asked = wanted if echo_only else max(wanted, 1)
                raise ContextTooLong(index, len(ids), asked, limit, echo_only and room == 0)
            # max_tokens 0 (echo): the engine makes one token, which `_sequence` drops.
            new_tokens.append(max(wanted, 1))
        charge = n * (sum(len(ids) for ids in prompt_ids) + sum(new_tokens))
        burst = self.service.settings.rate_limit_burst
        if charge > burst:
            raise TooManyTokens(charge, burst, n)
        await self.service.gate.admit(model, charge, deadline)
        timer.add("admission", self.service.clock() - tokenized_at)
        return PreparedGeneration(
            model, tuple(prompt_ids), tuple(new_tokens), sampling, stop_token_ids, deadline, now, n
        )

    def _vocabulary(self, model: str, tokenizer: GenerationTokenizer) -> int:
        """The ids a token-id prompt may hold: those of the tokenizer and of the model's
        embedding both (a fine-tune may add tokens without resizing it; on CUDA an id past
        it is a device-side assert, which loses the device)."""
        rows = self.service.output_width(model)  # the model's vocab_size, once loaded
        return tokenizer.vocabulary_size if rows is None else min(rows, tokenizer.vocabulary_size)

    async def stream(
        self, prepared: PreparedGeneration, timer: PhaseTimer, *, incremental: bool = True
    ) -> AsyncGenerator[list[GenerationEvent], None]:
        """Every sequence's pieces as they come (sequences interleaved), each followed by
        its `SequenceEnd`, in batches: the events that became known together (a batch never
        mixes sequences, and holds one piece at most). `incremental` False: nobody reads the
        text before the end, so a sequence without stop strings is sent by the engine in one
        output and decoded once (the same text). Raises what the engine answers (`Rejected`,
        `DeadlineExceeded`, `EngineRefused`, `BatchFailed`, `EngineUnavailable`). Close it
        (or cancel its task) to cancel the engine requests still running."""
        times = [_SequenceTime() for _ in range(prepared.sequences)]
        tokenizer = self.tokenizer(prepared.model)
        offsets = prepared.sampling.prompt_logprobs is not None
        prompts = prepared.prompt_ids if prepared.sampling.echo else ()
        echoes = PromptEchoes(self.service, tokenizer, prompts, offsets)
        sequences = [
            self._sequence(prepared, index, times[index], incremental, echoes)
            for index in range(prepared.sequences)
        ]
        try:
            at_engine = self.service.at_engine(
                prepared.model,
                "generate",
                prepared.arrived_at,
                counts_engine_refusals=_sent_as_several(prepared),
            )
            with at_engine as outcome:
                async with contextlib.aclosing(merge(sequences)) as batches:
                    async for batch in batches:
                        yield batch
                outcome.ok()
        finally:
            echoes.close()
            # The sequences ran side by side: the request's queue and compute phases are
            # those of the one that took longest, not their sum.
            slowest = max(times, key=lambda spent: spent.queue_s + spent.compute_s)
            timer.add("queue", slowest.queue_s)
            timer.add("compute", slowest.compute_s)

    async def _sequence(
        self,
        prepared: PreparedGeneration,
        index: int,
        spent: _SequenceTime,
        incremental: bool,
        echoes: PromptEchoes,
    ) -> AsyncGenerator[list[GenerationEvent], None]:
        """Sequence `index` (choice `index % n` of prompt `index // n`): each batch of
        engine outputs (one or more tokens that arrived together) becomes at most one piece,
        plus the end once it is known; what it spent in the engine goes to `spent`."""
        tokenizer = self.tokenizer(prepared.model)
        prompt, choice = divmod(index, prepared.n)
        prompt_ids = prepared.prompt_ids[prompt]
        stop_strings, wants_logprobs = prepared.sampling.stops, prepared.sampling.logprobs
        # Tokens before the end are read only to stream text or to watch for a stop string;
        # otherwise the engine sends one output, at the end (one message, not one per step).
        reads_as_it_goes = incremental or bool(stop_strings)
        # Log probabilities go with their tokens' text: read token by token, as for stops.
        aligner = LogprobAligner() if wants_logprobs is not None else None
        by_token = bool(stop_strings) or aligner is not None
        stops = StopMatcher(stop_strings) if by_token else None
        sampling = _engine_sampling(prepared, index)
        request = Submit(
            self.service.engine.next_request_id(),
            prepared.model,
            prepared.deadline,
            GeneratePayload(prompt_ids, sampling, stream=reads_as_it_goes),
            refusal_counted_by_sender=_sent_as_several(prepared),
        )
        detokenizer: IncrementalDetokenizer | WholeText
        if incremental or by_token:
            detokenizer = IncrementalDetokenizer(
                tokenizer.decode, prompt_ids, tokenizer.special_token_ids
            )
        else:
            detokenizer = WholeText(tokenizer.decode, prompt_ids)
        generated = 0
        first = True
        async with contextlib.aclosing(self.service.engine.stream_batches(request)) as outputs:
            async for batch in outputs:
                # Without stop strings the batch's tokens are decoded together; with them
                # (or log probabilities), each output is scanned as it was produced, so a
                # stop ends the sequence at the very output that reached it.
                text = ""
                token_ids: list[int] = []
                for output in batch:
                    payload = output.payload
                    if not isinstance(payload, TokensOutput):  # a server fault: answered 500
                        raise TypeError(
                            f"{prepared.model} answered generation with {type(payload)}"
                        )
                    if first:
                        spent.queue_s = output.queue_s
                        first = False
                        if prepared.sampling.echo:
                            echo, tokens = echoed(
                                await echoes.of(prompt),
                                prompt_ids,
                                payload.prompt_logprobs,
                                asked=prepared.sampling.prompt_logprobs is not None,
                            )
                            if aligner is not None:
                                aligner.skip(len(echo))
                            yield [TextPiece(index, echo, tokens)]
                            if prepared.sampling.max_new_tokens == 0:  # its token is dropped
                                prompts = payload.prompt_tokens
                                yield [SequenceEnd(index, "length", prompts, 0, choice)]
                                return
                    spent.compute_s += output.compute_s
                    if stops is None:
                        generated += len(payload.token_ids)
                        token_ids.extend(payload.token_ids)
                        continue
                    # Token by token: an output of several tokens (a whole answer's, or a
                    # run's handed over at once) may reach the stop with its first; those
                    # after it are neither sent nor counted.
                    # (A final output without tokens still flushes what the detokenizer holds.)
                    pieces = [[token] for token in payload.token_ids] or [[]]
                    for position, piece in enumerate(pieces):
                        generated += len(piece)
                        last_of_output = position == len(pieces) - 1
                        released = decoded(detokenizer, piece, output.final and last_of_output)
                        if aligner is not None:
                            aligner.add(payload, position, released, detokenizer.pending)
                        scan = stops.feed(released)
                        text += scan.text
                        if scan.stopped:  # leaving the engine stream cancels the sequence
                            ended = SequenceEnd(index, "stop", len(prompt_ids), generated, choice)
                            yield last_events(index, text, ended, aligner)
                            return
                last = batch[-1]
                if stops is None:
                    text = decoded(detokenizer, token_ids, last.final)
                if not last.final:
                    if text:
                        yield [TextPiece(index, text, carried(aligner, text, end=False))]
                    continue
                if stops is not None:
                    text += stops.flush()
                assert isinstance(last.payload, TokensOutput)
                end_token = last.payload.end
                if aligner is not None and prepared.sampling.logprobs_end:
                    if end_token is not None:
                        aligner.end(end_token.token_id, end_token.logprobs)
                    elif last.payload.finish_reason == FinishReason.EOS:
                        # An engine of this version always sends it (`take`): an older one
                        # does not, and lm-eval's `[:-1]` would cut the last prompt token.
                        raise TypeError("the engine sent no end token with its log probabilities")
                reason = _FINISH[last.payload.finish_reason or FinishReason.LENGTH]
                ended = SequenceEnd(index, reason, last.payload.prompt_tokens, generated, choice)
                yield last_events(index, text, ended, aligner)
                return
        raise EngineUnavailable("the engine's stream ended without a final output")


def _sent_as_several(prepared: PreparedGeneration) -> bool:
    """Whether the request goes to the engine as several Submits (one per sequence), whose
    refusal the front end counts once (`Submit.refusal_counted_by_sender`)."""
    return prepared.sequences > 1


def check_vocabulary(index: int, ids: Sequence[int], vocabulary_size: int) -> None:
    """Raises `TokenIdOutOfVocabulary` for the first id of prompt `index` past the vocabulary
    (the engine's embedding lookup would fail on it, or read a padding row)."""
    if ids and max(ids) >= vocabulary_size:
        bad = next(token for token in ids if token >= vocabulary_size)
        raise TokenIdOutOfVocabulary(index, bad, vocabulary_size)


def _encode_all(
    tokenizer: GenerationTokenizer, prompts: Sequence[str], add_special_tokens: bool
) -> list[list[int]]:
    return [tokenizer.encode(text, add_special_tokens) for text in prompts]


def _engine_sampling(prepared: PreparedGeneration, index: int) -> SamplingParams:
    """Sequence `index`'s sampling: choice `index % n` of prompt `index // n`."""
    sampling = prepared.sampling
    prompt, choice = divmod(index, prepared.n)
    return SamplingParams(
        max_new_tokens=prepared.new_tokens[prompt],
        do_sample=sampling.do_sample,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=sequence_seed(sampling.seed, prompt, choice),
        fit_to_deadline=sampling.max_new_tokens is None,
        stop_token_ids=prepared.stop_token_ids,
        logprobs=sampling.logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
    )
