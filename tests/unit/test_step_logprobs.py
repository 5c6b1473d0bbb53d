"""The engine's side of log probabilities: a step's chosen tokens' (the raw logits'
log-softmax and top-k, for the rows that asked alone, by position in their sequence's
sink), and a sequence taking them with the tokens it keeps and sending them with their
ids."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from app.engine.protocol import FinishReason, SamplingParams, TokensOutput
from app.engine.protocol_logprobs import TokenLogprobs
from app.models.causal_lm import StepRow
from app.models.logprobs import LogprobSink, record_logprobs
from app.models.sampling import NO_TOKEN
from tests.support.decode_runs import run_decode
from tests.support.stand_in_sequence import stand_in_sequence as sequence

EOS = frozenset({2})


def row(slot: int, logprobs: int | None, start: int = 6, fed: int = 1) -> StepRow:
    sampling = SamplingParams(max_new_tokens=8, logprobs=logprobs, temperature=0.3, top_k=2)
    sink: LogprobSink | None = None if logprobs is None else {}
    return StepRow(slot, [3] * fed, start, sampling, torch.Generator(), sink)


def test_rows_that_asked_get_the_raw_log_softmax_and_its_top_k_in_order() -> None:
    """Before the row's temperature and top-k (0.3 and 2 here): the model's distribution."""
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    rows = [row(0, 3), row(1, None), row(2, 0, start=0, fed=5), row(3, 20)]
    chosen = [7, 8, 9, 10]
    record_logprobs(logits, rows, chosen)
    expected = torch.log_softmax(logits, dim=-1)
    assert rows[1].logprobs is None
    for index, position, top in ((0, 7, 3), (2, 5, 0), (3, 7, 20)):
        sink = rows[index].logprobs
        assert sink is not None and list(sink) == [position]  # the chosen token's position
        entry = sink[position]
        assert entry.logprob == pytest.approx(expected[index, chosen[index]].item(), abs=1e-6)
        best = torch.topk(expected[index], top)
        assert entry.top_ids == best.indices.tolist()
        assert entry.top_logprobs == pytest.approx(best.values.tolist(), abs=1e-6)


def test_no_row_asking_costs_no_tensor_work_and_a_broken_row_gets_nothing() -> None:
    logits = torch.full((2, 5), float("nan"))  # any op on these would give NaN entries
    record_logprobs(logits, [row(0, None), row(1, None)], [1, 1])
    broken = row(0, 2)
    record_logprobs(logits, [broken], [NO_TOKEN])
    assert broken.logprobs == {}


def test_a_step_run_again_overwrites_what_it_wrote() -> None:
    """A failed step's triage runs a row again: its token's entry is the last run's."""
    asking = row(0, 1)
    record_logprobs(torch.tensor([[0.0, 1.0, 2.0]]), [asking], [2])
    record_logprobs(torch.tensor([[0.0, 0.0, 0.0]]), [asking], [1])
    assert asking.logprobs is not None
    (entry,) = asking.logprobs.values()
    assert entry.top_ids in ([0], [1], [2]) and entry.logprob == pytest.approx(-1.0986, abs=1e-4)


def test_more_alternatives_than_the_vocabulary_are_the_whole_vocabulary() -> None:
    asking = row(0, 20)
    record_logprobs(torch.tensor([[0.0, 1.0, 2.0]]), [asking], [2])
    assert asking.logprobs is not None and asking.logprobs[7].top_ids == [2, 1, 0]


def test_a_multi_step_run_carries_each_row_s_sink_to_its_later_steps() -> None:
    """Each step's row is made anew from the token it chose: with its sequence's sink."""
    seen: list[tuple[int, LogprobSink | None]] = []

    class Runner:
        name = "tiny"
        eos_token_ids = EOS

        def step(self, rows: Sequence[StepRow]) -> list[int]:
            seen.extend((r.start, r.logprobs) for r in rows)
            return [5 for _ in rows]

    asking = row(0, 1, start=3)
    assert run_decode(Runner(), [asking], 3) == {0: [5, 5, 5]}
    assert [start for start, _ in seen] == [3, 4, 5]
    assert all(sink is asking.logprobs for _, sink in seen)


def entry(logprob: float) -> TokenLogprobs:
    return TokenLogprobs(logprob, [], [])


async def test_a_sequence_takes_its_kept_tokens_entries_and_sends_them_with_their_ids() -> None:
    seq = sequence(10, logprobs=0)
    seq.slot = 0
    assert seq.logprob_sink == {} and seq.row().logprobs is seq.logprob_sink
    # Its prompt is 2 tokens: the first generated token is at position 2.
    seq.logprob_sink.update({2: entry(-0.2), 3: entry(-0.3)})
    assert seq.take([7, 8], EOS) == ([7, 8], None)
    assert seq.row().logprobs is seq.logprob_sink and seq.logprob_sink == {}
    first = seq.output([7, 8], None, 1.0, _Tracer())
    assert isinstance(first.payload, TokensOutput)
    assert first.payload.logprobs == [entry(-0.2), entry(-0.3)]
    seq.logprob_sink.update({4: entry(-0.4), 5: entry(-0.5)})  # 5: EOS, not kept
    assert seq.take([9, 2], EOS) == ([9], FinishReason.EOS)
    last = seq.output([9], FinishReason.EOS, 2.0, _Tracer())
    assert isinstance(last.payload, TokensOutput) and last.payload.logprobs == [entry(-0.4)]
    assert seq.token_logprobs == []  # it streams: those sent are not kept


async def test_a_sequence_that_does_not_stream_sends_every_token_s_at_its_end() -> None:
    seq = sequence(10, logprobs=0)
    seq.streams = False
    assert seq.logprob_sink is not None
    seq.logprob_sink.update({2: entry(-0.2), 3: entry(-0.3), 4: entry(-0.4)})
    seq.take([7, 8], EOS)
    seq.take([9], EOS)
    whole = seq.output(seq.generated, FinishReason.LENGTH, 2.0, _Tracer())
    assert isinstance(whole.payload, TokensOutput)
    assert whole.payload.logprobs == [entry(-0.2), entry(-0.3), entry(-0.4)]


async def test_a_sequence_that_did_not_ask_sends_none() -> None:
    seq = sequence(10)
    seq.slot = 0
    assert seq.logprob_sink is None and seq.row().logprobs is None
    seq.take([7], EOS)
    output = seq.output([7], None, 1.0, _Tracer())
    assert isinstance(output.payload, TokensOutput) and output.payload.logprobs is None


class _Tracer:
    def finish(self, arrival: object, batch: object) -> None:
        return None
