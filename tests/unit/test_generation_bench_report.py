"""The generation bench's pure parts (loadtest/generation_bench.py, generation_phases.py):
which ratios get a verdict, and which sequences a wave's latencies count."""

from __future__ import annotations

from loadtest.generation_bench import verdicts
from loadtest.generation_phases import Phase, Timing, wave_latencies

# 1000 tokens/s for steadyserve against 500 for transformers serve: a 2.00x ratio.
OURS = Phase("steadyserve", requests=4, tokens=1000, seconds=1.0)
OVERLOAD = Phase("overload", requests=4, tokens=1000, seconds=1.0)
SERVE = {"serve": Phase("transformers serve", requests=4, tokens=500, seconds=1.0)}


def _serve_line(lines: list[str]) -> str:
    (line,) = [line for line in lines if "transformers serve" in line]
    return line


def test_engine_only_ratio_to_transformers_serve_has_no_verdict() -> None:
    lines = verdicts("engine process", OURS, OVERLOAD, SERVE, over_http=False)
    assert _serve_line(lines) == "engine process / transformers serve --continuous-batching: 2.00x"


def test_http_ratio_to_transformers_serve_is_judged_against_its_target() -> None:
    lines = verdicts("HTTP", OURS, OVERLOAD, SERVE, over_http=True)
    assert _serve_line(lines).endswith("2.00x (target >= 1.2: met)")


def test_a_sequence_with_no_token_is_left_out_of_the_engine_waves_ttft() -> None:
    answered = Timing(submitted=10.0, first=10.05, last=10.35, tokens=4)
    tokenless = Timing(submitted=10.0)  # answered, but ended before any token
    ttft, tpot = wave_latencies([answered, tokenless])
    assert [round(v, 6) for v in ttft] == [50.0]
    assert [round(v, 6) for v in tpot] == [100.0]  # (10.35 - 10.05) / 3 tokens after the first
