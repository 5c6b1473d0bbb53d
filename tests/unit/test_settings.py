"""Settings: defaults, environment parsing and consistency checks."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from pydantic import ValidationError

from app.settings import Settings
from app.startup import policy_for


def test_defaults_are_consistent() -> None:
    settings = Settings()
    assert settings.default_model_name == "all-MiniLM-L6-v2"
    assert settings.dispatcher_threads is None  # sized from the CPU quota at start-up


def test_environment_is_read_at_construction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STEADY_LENGTH_BUCKETS", "[8,32]")
    monkeypatch.setenv("STEADY_MAX_INFLIGHT", "7")
    monkeypatch.setenv("STEADY_MODELS", '[{"name": "a"}, {"name": "b", "source": "/m"}]')
    settings = Settings()
    assert settings.length_buckets == (8, 32)
    assert settings.max_inflight == 7
    assert [m.name for m in settings.models] == ["a", "b"]


@pytest.mark.parametrize(
    "overrides",
    [
        {"length_buckets": (32, 16)},
        {"max_inputs_per_request": 100, "rate_limit_burst": 50},
        {"default_model": "missing"},
        {"models": ({"name": "x"}, {"name": "x"})},
        {"engine_restart_backoff_s": (0.0, 0.0)},  # a crashing process respawned at once
        {"engine_restart_backoff_s": (60.0, 5.0)},
        {"health_port": 8000, "port": 8000},  # the probe listener takes the traffic port
        {"keep_alive_timeout_s": 0.5},  # uvicorn's whole seconds: 0, every idle one closed
        {"max_batch_tokens": 256},  # one input of the 512 bucket is 512 tokens
        {"log_level": "warn"},  # Python's logging takes it, uvicorn does not
        # A chat without max_tokens is charged a whole slot: every one was refused 413.
        {
            "models": ({"name": "lm", "task": "generate", "source": "/m"},),
            "generate_slot_tokens": 40_000,
            "generate_max_batch_tokens": 40_000,
        },
    ],
)
def test_inconsistent_settings_are_refused(overrides: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        Settings(**overrides)  # type: ignore[arg-type]


def test_a_models_policy_stops_at_its_longest_input() -> None:
    """At the bucket holding it, cut to it: no batch is padded past what the model takes."""
    settings = Settings(length_buckets=(16, 32, 64, 128, 256, 512))
    assert policy_for(settings, 256).length_buckets == (16, 32, 64, 128, 256)
    assert policy_for(settings, 100).length_buckets == (16, 32, 64, 100)
    assert policy_for(settings, 512).length_buckets == (16, 32, 64, 128, 256, 512)


def test_no_bucket_pads_past_a_models_positions() -> None:
    """A BERT of 512 positions with buckets (384, 768): its inputs of 385-512 tokens were
    padded to 768, and BertEmbeddings failed on every batch of them (and in warm-up)."""
    settings = Settings(length_buckets=(128, 384, 768), rate_limit_burst=1_000_000)
    policy = policy_for(settings, 512)
    assert policy.length_buckets == (128, 384, 512)
    assert max(shape.length for shape in policy.shapes()) == 512
    assert policy.length_bucket_for(512) == 512 and policy.length_bucket_for(385) == 512


def test_the_log_level_is_taken_in_any_case() -> None:
    assert Settings(log_level="WARNING").log_level == "warning"  # type: ignore[arg-type]


def test_serve_names_each_bad_setting_by_its_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """One line each, exit 2, instead of a pydantic traceback naming fields."""
    from app.cli import main

    monkeypatch.setenv("STEADY_MAX_BATCH_SIZE", "abc")
    monkeypatch.setenv("STEADY_LOG_LEVEL", "warn")
    assert main(["serve"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert {line.split(":")[1].strip() for line in lines} == {
        "STEADY_MAX_BATCH_SIZE",
        "STEADY_LOG_LEVEL",
    }


@pytest.mark.parametrize(
    "variable,value",
    [
        ("STEADY_LENGTH_BUCKETS", "16,32"),
        ("STEADY_MODELS", "notjson"),
        ("STEADY_ENGINE_RESTART_BACKOFF_S", "1,30"),
    ],
)
def test_serve_names_a_list_variable_that_is_not_json(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], variable: str, value: str
) -> None:
    """pydantic-settings fails to parse it before validation (a SettingsError, a traceback)."""
    from app.cli import main

    monkeypatch.setenv(variable, value)
    assert main(["serve"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("steadyserve: ") and variable.lower().removeprefix("steady_") in error


def test_settings_refuses_arguments_it_does_not_take() -> None:
    from app.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(["settings", "--bogus", "x"])
    assert stopped.value.code == 2


def serve_exit(*arguments: str) -> subprocess.CompletedProcess[str]:
    """`steadyserve serve` in a child, bounded: a regression starts a server instead of
    refusing, and the timeout ends it (its children die with it)."""
    return subprocess.run(
        [sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", *arguments],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_refuses_a_port_something_else_listens_on() -> None:
    """Every front end failed to bind it and was restarted forever, with /healthz 200."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = serve_exit("--port", str(port))
    assert result.returncode == 2
    # Said once, in the supervisor's log (stderr): it was written to stderr besides.
    assert result.stderr.count(f"cannot listen on 127.0.0.1:{port}") == 1


def test_serve_refuses_port_0_for_its_front_ends() -> None:
    result = serve_exit("--port", "0")
    assert result.returncode == 2 and "port 0" in result.stderr


def test_every_batch_size_the_settings_allow_has_its_own_histogram_bucket() -> None:
    """A batch over the largest bucket (256) fell in +Inf: every quantile read 256."""
    from app.metrics import BATCH_SIZE_BUCKETS

    largest = 1024
    assert Settings(max_batch_size=largest).max_batch_size <= max(BATCH_SIZE_BUCKETS)
    with pytest.raises(ValidationError):
        Settings(max_batch_size=largest + 1)


def test_a_server_without_generate_models_needs_no_burst_for_a_kv_slot() -> None:
    Settings(
        rate_limit_burst=16, length_buckets=(16,), max_batch_tokens=16, max_inputs_per_request=1
    )


def test_a_compute_some_request_may_still_wait_for_is_never_called_stuck() -> None:
    """The supervisor kills an engine whose compute runs past `stuck_compute_s`: below
    the longest deadline it could kill one slow but still awaited (a large batch, a long
    multi-step run), failing every request in the engine."""
    Settings(max_timeout_ms=120_000, stuck_compute_s=120, drain_timeout_s=120)
    with pytest.raises(ValidationError, match="stuck_compute_s must be at least"):
        Settings(max_timeout_ms=120_000)  # the 60 s default


def test_the_drain_lasts_as_long_as_the_longest_deadline() -> None:
    """A 300 s deadline with the default 60 s drain was accepted (check-config too): a
    generation admitted just before SIGTERM was cut 240 s short."""
    longest = {"max_timeout_ms": 300_000, "stuck_compute_s": 300}
    assert Settings(**longest, drain_timeout_s=300).drain_timeout_s == 300  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="drain_timeout_s must be at least max_timeout_ms"):
        Settings(**longest)  # type: ignore[arg-type]


def test_a_default_deadline_past_the_longest_is_refused() -> None:
    """A default of 90 s under a 60 s bound was taken and silently cut to 60 s."""
    Settings(default_timeout_ms=60_000)
    with pytest.raises(ValidationError, match="default_timeout_ms must not exceed max_timeout_ms"):
        Settings(default_timeout_ms=90_000)


@pytest.mark.parametrize("name", ["team/scorer", "", "../a", "a b", ".hidden"])
def test_a_model_name_that_is_no_path_segment_is_refused(name: str) -> None:
    """/v2/models/{name}/infer cannot route a '/', and a request naming "" got the default
    model: both names were accepted."""
    with pytest.raises(ValidationError, match=r"models\.0\.name"):
        Settings(models=({"name": name},))  # type: ignore[arg-type]


def test_a_hugging_face_id_is_a_source_not_a_name() -> None:
    source = "sentence-transformers/all-MiniLM-L6-v2"
    for name in ("all-MiniLM-L6-v2", "bge-small-en-v1.5", "qwen2.5:0.5b", "_private"):
        (model,) = Settings(models=({"name": name, "source": source},)).models  # type: ignore[arg-type]
        assert (model.name, model.source) == (name, source)


def test_a_model_that_fails_gives_its_error_only(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown task also gave "models: Tuple should have at least 1 item after
    validation, not 0" (the check ran on what was left once the model failed)."""
    from app.cli import main

    monkeypatch.setenv("STEADY_MODELS", '[{"name": "a", "task": "classify"}]')
    assert main(["serve"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("steadyserve: STEADY_MODELS: Input should be 'embed'")
    with pytest.raises(ValidationError, match="at least one model is needed"):
        Settings(models=())


def test_the_serve_flags_a_command_line_sets_are_read_by_the_servers_parser() -> None:
    """check-config reads the server container's args with it (`serve` applies them)."""
    from app.cli import CommandLineError, serve_command_overrides

    flags = ["serve", "--host", "0.0.0.0", "--port", "8000"]
    assert serve_command_overrides(flags) == {"host": "0.0.0.0", "port": 8000}
    assert serve_command_overrides(["serve"]) == {}
    for refused in (["serve", "--bogus"], ["serve", "--port", "x"], ["settings"], []):
        with pytest.raises(CommandLineError):
            serve_command_overrides(refused)


def test_the_prefill_budget_must_hold_a_chunk_not_a_whole_slot() -> None:
    """Chunked prefill: a step prefills a chunk of each prompt, so the batch budget may be
    below the slot size (it had to hold a whole slot before), but not below a chunk."""
    fits = Settings(
        generate_slot_tokens=4096,
        generate_max_batch_tokens=512,
        generate_prefill_chunk_tokens=256,
        rate_limit_burst=40_000,
    )
    assert fits.generate_max_batch_tokens == 512
    with pytest.raises(ValidationError, match="one prefill chunk"):
        Settings(generate_max_batch_tokens=100, generate_prefill_chunk_tokens=128)
