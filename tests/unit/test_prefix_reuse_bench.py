"""The prefix reuse bench's pure parts (loadtest/prefix_reuse_bench.py): its options, the
prompts each workload sends, and the report's table and on/off ratios on canned waves."""

from __future__ import annotations

from typing import Any

import pytest

from loadtest.generation_phases import Phase
from loadtest.prefix_reuse_bench import PREFILLED, Prompts, parse_args, report


def _wave(tokens_per_s: float, ttft_ms: float, prefilled: float | None) -> Phase:
    extra = {} if prefilled is None else {PREFILLED: prefilled}
    return Phase("w", requests=4, tokens=int(tokens_per_s), seconds=1.0, ttft_ms=(ttft_ms,) * 4,
                 extra=extra)  # fmt: skip


def test_defaults_are_the_briefs_workload() -> None:
    options = parse_args([])
    assert (options.prefix_tokens, options.tail_tokens) == (384, 16)
    assert (options.requests, options.new_tokens, options.rounds) == (32, 16, 2)


def test_a_prompt_and_its_answer_must_fit_a_slot() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--prefix-tokens", "490", "--tail-tokens", "16", "--new-tokens", "16"])
    with pytest.raises(SystemExit):
        parse_args(["--waves", "0"])


class _Tokenizer:
    bos_token_id = 1

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, Any]:
        return {"input_ids": [10 + i % 300 for i in range(len(text.split()))]}


def test_shared_prompts_share_the_prefix_and_new_tails_each_wave() -> None:
    options = parse_args(["--prefix-tokens", "40", "--tail-tokens", "8", "--requests", "4"])
    prompts = Prompts(_Tokenizer(), options)
    first, second = prompts.wave("shared", 0), prompts.wave("shared", 1)
    for prompt in first + second:
        assert len(prompt) == 48 and prompt[:40] == prompts.prefix
    assert {tuple(p[40:]) for p in first}.isdisjoint(tuple(p[40:]) for p in second)
    for prompt in prompts.wave("control", 1):
        assert len(prompt) == 48 and prompt[:1] == [1] and prompt[1:16] != prompts.prefix[1:16]


def test_report_gives_each_setting_and_the_on_off_ratios() -> None:
    results = {
        ("shared", True): [_wave(2000, 10.0, 128), _wave(2000, 10.0, 128)],
        ("shared", False): [_wave(1000, 40.0, 12800), _wave(1000, 40.0, 12800)],
        ("control", True): [_wave(990, 41.0, 12800)],
        ("control", False): [_wave(1000, 41.0, None)],  # counter not read
    }
    text = report(results, 384)
    lines = text.splitlines()
    assert "| shared | on | 2 | 2000 | 10.0 / 10.0 | 128 |" in lines
    assert "| shared | off | 2 | 1000 | 40.0 / 40.0 | 12800 |" in lines
    assert "| shared | on/off | | 2.00x | 0.25x (p50) | |" in lines
    assert "| control | off | 1 | 1000 | 41.0 / 41.0 | - |" in lines
    assert lines[-1] == (
        "prefix reuse on/off: shared 384-token prefix: tokens/s 2.00x, TTFT p50 0.25x; "
        "control (no shared prefix): tokens/s 0.99x, TTFT p50 1.00x"
    )


def test_a_setting_measured_alone_gives_no_ratio() -> None:
    text = report({("shared", True): [_wave(2000, 10.0, 128)]}, 384)
    assert "on/off |" not in text
    assert text.endswith("prefix reuse on/off: no pair measured")
