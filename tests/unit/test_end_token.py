"""The token that ends a sequence at EOS (or a stop token id) in completions' logprobs: the
engine keeps it out of the generated tokens but sends it and its log probabilities with the
final output (`TokensOutput.end`), and the front end's aligner lists it last, at the text's
end. Before, its log probabilities were dropped, and lm-eval-harness's `[:-1]` over an echo
cut the continuation's last token."""

from __future__ import annotations

import msgspec
import pytest

from app.engine.generation_sequences import GenerationSequence
from app.engine.protocol import (
    FinishReason,
    Output,
    TokensOutput,
    decode_from_engine,
    encode,
)
from app.engine.protocol_logprobs import EndToken, TokenLogprobs
from app.generation.logprobs import LogprobAligner
from tests.support.stand_in_sequence import stand_in_sequence

EOS = frozenset({2})


class _Tracer:
    def finish(self, arrival: object, batch: object) -> None:
        return None


def _sequence(stop_token_ids: tuple[int, ...] = ()) -> GenerationSequence:
    return stand_in_sequence(8, stop_token_ids=stop_token_ids, logprobs=1, prompt=(1, 5, 9), slot=0)


def _lp(value: float) -> TokenLogprobs:
    return TokenLogprobs(value, [7], [-0.5])


@pytest.mark.parametrize(("ending", "stops"), [(2, ()), (40, (40,))])
async def test_the_final_output_carries_the_ending_token(
    ending: int, stops: tuple[int, ...]
) -> None:
    """A multi-step run's tokens [7, ending, 8]: 7 is kept, the ending token goes with the
    final output (the steps wrote every chosen token's at its position), 8 is dropped."""
    seq = _sequence(stops)
    assert seq.logprob_sink is not None
    seq.logprob_sink.update({3: _lp(-1.0), 4: _lp(-2.0), 5: _lp(-3.0)})
    fresh, finish = seq.take([7, ending, 8], EOS)
    assert fresh == [7] and finish is FinishReason.EOS
    payload = seq.output(fresh, finish, 1.0, _Tracer()).payload  # type: ignore[arg-type]
    assert isinstance(payload, TokensOutput)
    assert payload.token_ids == [7] and payload.logprobs == [_lp(-1.0)]
    assert payload.end == EndToken(ending, _lp(-2.0))


async def test_no_end_token_for_a_length_end_or_an_earlier_output() -> None:
    seq = _sequence()
    assert seq.logprob_sink is not None
    seq.logprob_sink.update({3: _lp(-1.0)})
    fresh, finish = seq.take([7], EOS)
    assert finish is None
    assert seq.output(fresh, None, 1.0, _Tracer()).payload.end is None  # type: ignore[arg-type, union-attr]


def test_end_is_optional_on_the_wire_both_ways() -> None:
    """An older engine's final output (no `end`) decodes with None; a newer one's decodes
    where an older front end reads it (msgspec skips a field it does not know)."""

    class OldTokensOutput(msgspec.Struct, frozen=True, tag="tokens"):
        token_ids: list[int]
        prompt_tokens: int
        finish_reason: FinishReason | None = None
        logprobs: list[TokenLogprobs] | None = None
        prompt_logprobs: list[TokenLogprobs] | None = None

    old = msgspec.msgpack.encode(OldTokensOutput([7], 3, FinishReason.EOS, [_lp(-1.0)]))
    assert msgspec.msgpack.decode(old, type=TokensOutput).end is None
    new = TokensOutput([7], 3, FinishReason.EOS, [_lp(-1.0)], None, EndToken(2, _lp(-2.0)))
    output = decode_from_engine(encode(Output(1, True, new, 0.0, 0.0)))
    assert isinstance(output, Output) and output.payload == new
    read_by_old = msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldTokensOutput)
    assert read_by_old.token_ids == [7]


def test_the_aligner_lists_the_end_token_last_at_the_text_s_end() -> None:
    aligner = LogprobAligner()
    aligner.skip(5)  # an echoed prompt's text
    aligner.add(TokensOutput([7], 3, None, [_lp(-1.0)]), 0, "ab")
    aligner.end(2, _lp(-2.0))
    tokens = aligner.rest("ab")
    assert [(t.token_id, t.text_offset, t.logprobs) for t in tokens] == [
        (7, 5, _lp(-1.0)),
        (2, 7, _lp(-2.0)),
    ]
    assert aligner.rest("") == ()  # listed once
