"""A prompt's own log probabilities (completions' `echo`): the engine's chunked head over a
prefill's positions (`record_prompt_logprobs`), a sequence taking them from its sink after
its prefill and sending them with its first output only, and the front end's echoed text,
offsets and null first entry (`echo.py`, the completion render)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from app.api.openai_format import Reply, whole
from app.api.openai_logprobs import LogprobRender
from app.engine.generation_sequences import GenerationSequence
from app.engine.protocol import TokensOutput
from app.engine.protocol_logprobs import TokenLogprobs
from app.generation.echo import echo_text, echoed
from app.generation.events import SequenceEnd
from app.generation.logprobs import LogprobAligner
from app.models.causal_lm import StepRow
from app.models.logprobs import LogprobSink, record_logprobs, record_prompt_logprobs
from tests.support.stand_in_sequence import stand_in_sequence

EOS = frozenset({2})
VOCABULARY = 50


def _head() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(8, VOCABULARY)


def test_chunks_give_what_one_pass_gives_and_the_reference() -> None:
    """Token p's is the log-softmax after position p - 1 gathered at token p, at sink
    position p; one position per chunk, three, or all at once, the same values."""
    head = _head()
    hidden = torch.randn(9, 8)
    prompt = [3, 17, 4, 4, 49, 0, 12, 8, 30, 7]  # one more than the positions read

    def logits_of(states: torch.Tensor) -> torch.Tensor:
        return torch.tanh(head(states) / 2.0) * 2.0  # a transform, as a softcap

    sinks: list[LogprobSink] = []
    with torch.inference_mode():
        for elements in (1, 3 * VOCABULARY, 2**24):
            sink: LogprobSink = {}
            record_prompt_logprobs(hidden, prompt, 3, sink, logits_of, VOCABULARY, elements)
            sinks.append(sink)
        expected = torch.log_softmax(logits_of(hidden), dim=-1)
    assert sorted(sinks[0]) == list(range(1, len(prompt)))
    for p in range(1, len(prompt)):
        best = torch.topk(expected[p - 1], 3)
        for sink in sinks:
            assert sink[p].logprob == pytest.approx(expected[p - 1, prompt[p]].item(), abs=1e-5)
            assert sink[p].top_ids == best.indices.tolist()
            assert sink[p].top_logprobs == pytest.approx(best.values.tolist(), abs=1e-5)


def test_a_one_token_prompt_has_none() -> None:
    sink: LogprobSink = {}
    record_prompt_logprobs(torch.randn(0, 8), [5], 2, sink, _head(), VOCABULARY)
    assert sink == {}


def _sequence(prompt: Sequence[int], logprobs: int | None, streams: bool) -> GenerationSequence:
    return stand_in_sequence(
        4, logprobs=logprobs, prompt=prompt, prompt_logprobs=1, streams=streams, slot=0
    )


class _Tracer:
    def finish(self, arrival: object, batch: object) -> None:
        return None


@pytest.mark.parametrize("streams", [True, False])
async def test_a_sequence_sends_its_prompt_s_with_its_first_output_alone(streams: bool) -> None:
    """Prompt logprobs without the generated tokens': the sink is emptied by the prefill's
    take, and no step writes the generated tokens' into it (it would grow without end)."""
    seq = _sequence([1, 5, 9], logprobs=None, streams=streams)
    assert seq.logprob_sink == {}
    row = seq.row()
    assert isinstance(row, StepRow) and row.logprobs is seq.logprob_sink
    with torch.inference_mode():
        record_prompt_logprobs(torch.randn(2, 8), seq.prompt, 1, seq.logprob_sink, _head(), 50)
    record_logprobs(torch.randn(1, VOCABULARY), [row], [7])  # generated: not asked
    assert sorted(seq.logprob_sink) == [1, 2]
    fresh, _ = seq.take([7], EOS)
    assert seq.logprob_sink == {}
    first = seq.output(fresh, None, 1.0, _Tracer())  # type: ignore[arg-type]
    prompt_logprobs = first.payload.prompt_logprobs  # type: ignore[union-attr]
    assert prompt_logprobs is not None and len(prompt_logprobs) == 2
    assert first.payload.logprobs is None  # type: ignore[union-attr]
    seq.take([8], EOS)
    later = seq.output([8], None, 2.0, _Tracer())  # type: ignore[arg-type]
    assert later.payload.prompt_logprobs is None  # type: ignore[union-attr]


async def test_both_asked_the_generated_tokens_come_out_of_the_sink_too() -> None:
    seq = _sequence([1, 5], logprobs=0, streams=True)
    row = seq.row()
    assert seq.logprob_sink is not None
    with torch.inference_mode():
        record_prompt_logprobs(torch.randn(1, 8), seq.prompt, 1, seq.logprob_sink, _head(), 50)
    record_logprobs(torch.randn(1, VOCABULARY), [row], [7])
    fresh, _ = seq.take([7], EOS)
    assert seq.logprob_sink == {}
    payload = seq.output(fresh, None, 1.0, _Tracer()).payload  # type: ignore[arg-type]
    assert len(payload.logprobs or []) == 1 and len(payload.prompt_logprobs or []) == 1  # type: ignore[union-attr]


TEXTS = {1: "", 10: "Hel", 11: "lo", 12: " w", 13: "\u00e9", 14: "!"}


def _decode(ids: Sequence[int]) -> str:
    return "".join(TEXTS[i] for i in ids if i != 1)


def _lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(value, [10], [-0.1])


def test_the_echoed_prompt_s_offsets_and_its_first_token_s_null() -> None:
    """BOS (special, no text) begins at 0 with null log probabilities; each token after it
    where its text begins; generated tokens' offsets begin after the prompt's text."""
    prompt = [1, 10, 11, 12, 14]
    echo = echo_text(_decode, {1}, prompt, offsets=True)
    text, tokens = echoed(echo, prompt, [_lp(-1.0), _lp(-2.0), _lp(-3.0), _lp(-4.0)], asked=True)
    assert text == "Hello w!"
    assert [t.token_id for t in tokens] == prompt
    assert [t.text_offset for t in tokens] == [0, 0, 3, 5, 7]
    assert tokens[0].logprobs is None and tokens[4].logprobs == _lp(-4.0)
    assert echoed(echo_text(_decode, {1}, prompt, False), prompt, None, False) == ("Hello w!", ())
    with pytest.raises(TypeError):
        echoed(echo, prompt, [_lp(-1.0)], asked=True)
    aligner = LogprobAligner()
    aligner.skip(len(text))
    aligner.add(TokensOutput([13], 5, None, [_lp(-0.5)]), 0, "\u00e9")
    (generated,) = aligner.rest("\u00e9")
    assert generated.text_offset == len(text)

    class _Names:
        def named(self, token_id: int) -> tuple[str, bytes]:
            return TEXTS[token_id] or "<s>", TEXTS[token_id].encode()

    reply = Reply("tiny", chat=False, logprobs=LogprobRender(_Names(), chat=False))  # type: ignore[arg-type]
    end = SequenceEnd(0, "length", 5, 1)
    body = whole(reply, [text + "\u00e9"], [end], [[*tokens, generated]])
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<s>", "Hel", "lo", " w", "!", "\u00e9"]
    assert logprobs["token_logprobs"] == [None, -1.0, -2.0, -3.0, -4.0, -0.5]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1:3] == [{"Hel": -0.1}, {"Hel": -0.1, "lo": -2.0}]
    assert logprobs["text_offset"] == [0, 0, 3, 5, 7, 8]


def test_prompt_logprobs_asked_and_not_sent_are_a_server_fault() -> None:
    """An older engine drops `SamplingParams.prompt_logprobs` (msgspec skips a field it does
    not know) and sends none: the echo must not be a 200 without them (lm-eval would sum
    nothing), but a 500, as tokens without their log probabilities are."""
    with pytest.raises(TypeError, match="no log probabilities of the prompt"):
        echoed(echo_text(_decode, {1}, [1, 10, 11], True), [1, 10, 11], None, asked=True)
