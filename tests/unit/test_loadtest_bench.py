"""The bench's comparison arithmetic, on phase figures given by hand (no model, no server)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from loadtest.bench import build_parser, comparison_table
from loadtest.bench_phases import PhaseOutcome, bench_sentences
from loadtest.torchserve_phase import TorchServeLayout


def _phase(name: str, rps: float, p50: float, p99: float) -> PhaseOutcome:
    return PhaseOutcome(name, name, rps, p50, p50 * 1.1, p99, 0.0)


def test_ratios_and_target_marks() -> None:
    outcomes = {
        "raw": _phase("raw", 1000.0, 40.0, 50.0),
        "naive": _phase("naive", 100.0, 600.0, 900.0),
        "steadyserve": _phase("steadyserve", 850.0, 70.0, 98.0),
    }
    table, ratios = comparison_table(outcomes)
    assert ratios["steadyserve/raw"] == pytest.approx(0.85)
    assert ratios["steadyserve/naive"] == pytest.approx(8.5)
    assert ratios["steadyserve p99/p50"] == pytest.approx(1.4)
    assert ratios["naive p99/p50"] == pytest.approx(1.5)
    assert "(target >= 0.8: met)" in table
    assert "(target >= 4: met)" in table
    assert "(target <= 1.5: met)" in table


def test_torchserve_ratio_has_the_issue_target() -> None:
    outcomes = {
        "torchserve": _phase("torchserve", 600.0, 90.0, 200.0),
        "steadyserve": _phase("steadyserve", 1020.0, 60.0, 70.0),
    }
    table, ratios = comparison_table(outcomes)
    assert ratios["steadyserve/torchserve"] == pytest.approx(1.7)
    assert "steadyserve/torchserve     1.70   (target >= 1.6: met)" in table
    outcomes["steadyserve"] = _phase("steadyserve", 900.0, 60.0, 70.0)
    assert "(target >= 1.6: NOT met)" in comparison_table(outcomes)[0]


def test_torchserve_config_batches_as_the_bench_asks() -> None:
    layout = TorchServeLayout(
        inference_port=9101,
        management_port=9102,
        metrics_port=9103,
        batch_size=64,
        max_batch_delay_ms=10,
        workers=2,
        threads_per_worker=1,
        dtype="bfloat16",
    )
    lines = dict(line.split("=", 1) for line in layout.config_properties().splitlines())
    assert lines["inference_address"] == "http://127.0.0.1:9101"
    assert lines["management_address"] == "http://127.0.0.1:9102"
    assert lines["metrics_address"] == "http://127.0.0.1:9103"
    model = json.loads(lines["models"])["minilm"]["1.0"]
    assert model["batchSize"] == 64
    assert model["maxBatchDelay"] == 10
    assert model["minWorkers"] == model["maxWorkers"] == 2
    assert lines["load_models"] == model["marName"] == "minilm.mar"
    assert layout.ready_url == "http://127.0.0.1:9101/ping"
    assert layout.inference_path == "/predictions/minilm"


def test_missed_targets_are_marked_and_missing_phases_give_no_ratio() -> None:
    outcomes = {
        "raw": _phase("raw", 1000.0, 40.0, 50.0),
        "steadyserve": _phase("steadyserve", 500.0, 50.0, 100.0),
    }
    table, ratios = comparison_table(outcomes)
    assert ratios["steadyserve/raw"] == pytest.approx(0.5)
    assert ratios["steadyserve/naive"] is None
    assert ratios["steadyserve/torchserve"] is None
    assert "(target >= 0.8: NOT met)" in table
    assert "(target <= 1.5: NOT met)" in table


def test_bench_sentences_have_the_requested_words_and_are_reproducible() -> None:
    sentences = bench_sentences(50, 12, seed=1)
    assert all(len(text.split()) == 12 for text in sentences)
    assert sentences == bench_sentences(50, 12, seed=1)
    assert len(set(sentences)) == 50


def test_overhead_verdict_is_the_ratio_of_means_with_the_spread() -> None:
    from loadtest.overhead import verdict

    ratio, spread = verdict({"off": [100.0, 104.0], "on": [99.0, 101.0]})
    assert ratio == pytest.approx(100.0 / 102.0)
    assert spread == pytest.approx(4.0 / 102.0)


class _SleepingModel:
    """A model whose batches all take the same time: the larger the batch, the more
    sentences per second, so the sweep's best batch is its largest."""

    def embed_fast(self, batch: list[str]) -> None:
        time.sleep(0.002)


def test_the_raw_reference_is_the_raw_batch_not_the_sweeps_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 7's target is steadyserve >= 0.8x the raw model at batch 64; the raw phase
    measured the sweep's best batch (128 on every machine so far) and the ratio was against
    that."""
    from loadtest import bench_phases

    monkeypatch.setattr(bench_phases, "configure_torch", lambda threads: None)
    monkeypatch.setattr(bench_phases.MiniLM, "load", staticmethod(lambda dtype: _SleepingModel()))
    options = build_parser().parse_args([])
    assert options.raw_batch == 64  # the default: the target's batch
    options.batch_sizes, options.sweep_seconds, options.duration_s = [1, 64, 128], 0.05, 0.2
    outcome = bench_phases.measure_raw(options, bench_sentences(200, 12, seed=1), tmp_path)
    sweep = outcome.details["sweep_sentences_per_s"]
    assert outcome.details["best_batch_size"] == 128  # reported beside it
    assert outcome.description == "raw in-process, batch 64"
    # Batch 64's rate (half of 128's here), which steadyserve/raw divides by.
    assert outcome.throughput_rps == pytest.approx(sweep["64"], rel=0.25)
    assert outcome.throughput_rps < 0.75 * sweep["128"]
    table, _ = comparison_table({"raw": outcome, "steadyserve": _phase("s", 1000.0, 1, 1)})
    assert "(raw at batch 64)" in table
    assert "raw's best batch in the sweep: 128" in table
