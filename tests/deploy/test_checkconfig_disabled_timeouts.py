"""`steadyserve check-config` on Envoy timeouts set to `0s`, which Envoy reads as "no timeout"
(a route's `timeout` and `idle_timeout`, the listener's `stream_idle_timeout`, the
`idle_timeout` of its connections, downstream and upstream): read as disabled, never as a
timeout of zero seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from app.checkconfig.envoy_config import read_envoy
from app.checkconfig.invariants import OverlayValues, _check_shutdown
from app.settings import Settings
from tests.deploy.checkconfig_support import check, replace_once
from tests.deploy.tools import DEPLOY

GENERATION_ROUTES = ("completions_route", "chat_route")
# The generation routes' own lines (one route, a YAML alias, serves both paths).
GENERATION_TIMEOUT = " " * 28 + "timeout: 60s\n"
GENERATION_IDLE = " " * 28 + "idle_timeout: 60s\n"
LISTENER_STREAM_IDLE = "stream_idle_timeout: 30s\n"
UPSTREAM_IDLE = "\n" + " " * 12 + "idle_timeout: 60s"  # the cluster's (routes have theirs)


def disable_generation_route_timeout(deploy: Path) -> None:
    replace_once(
        deploy / "envoy" / "envoy.yaml", GENERATION_TIMEOUT, GENERATION_TIMEOUT.replace("60s", "0s")
    )


def test_a_disabled_route_timeout_is_refused_with_what_the_server_applies_instead(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read as 0.0 it never exceeded max_timeout_ms and passed; Envoy then sends no
    x-envoy-expected-rq-timeout-ms, and the server cuts a request at default_timeout_ms."""
    disable_generation_route_timeout(deploy_copy)
    for route in GENERATION_ROUTES:
        replace_once(
            deploy_copy / "baseline.yaml", f"{route}_timeout_s: 60.0", f"{route}_timeout_s: 0.0"
        )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for overlay in ("cpu", "gpu"):
        for route in GENERATION_ROUTES:
            assert (
                f"k8s[{overlay}].envoy.{route}_timeout_s: 0s disables Envoy's route timeout: "
                "Envoy then sends no x-envoy-expected-rq-timeout-ms, so a request without its "
                "own timeout_ms gets the server's default_timeout_ms (10000) and is answered "
                "504 then" in out
            )
    # The baseline's 0.0 means the same (no drift line), and no idle timeout is "under" it.
    assert "baseline" not in out.replace(f"from {deploy_copy / 'baseline.yaml'}", "")
    assert "is under its route timeout" not in out
    assert out.count("\n") == 5, out  # 2 routes x 2 overlays, and the summary


def test_a_route_timeout_disabled_against_the_baseline_is_named_as_disabled(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    disable_generation_route_timeout(deploy_copy)
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for route in GENERATION_ROUTES:
        assert f"envoy.{route}_timeout_s: baseline 60.0, actual 0s (disabled)" in out


# A stream idle timeout disabled where a route gets it: (the line in envoy.yaml, its
# disabled form, the baseline keys that change with it).
DISABLED_IDLE_TIMEOUTS = {
    "the generation routes' own": (
        GENERATION_IDLE,
        GENERATION_IDLE.replace("60s", "0s"),
        [f"{route}_idle_timeout_s: 60.0" for route in GENERATION_ROUTES],
    ),
    "the listener's, which /infer keeps": (
        LISTENER_STREAM_IDLE,
        LISTENER_STREAM_IDLE.replace("30s", "0s"),
        ["downstream_stream_idle_timeout_s: 30.0"],
    ),
}


@pytest.mark.parametrize(
    ("line", "disabled", "baseline_entries"),
    DISABLED_IDLE_TIMEOUTS.values(),
    ids=DISABLED_IDLE_TIMEOUTS.keys(),
)
def test_a_disabled_stream_idle_timeout_is_never_under_the_route_timeout(
    line: str,
    disabled: str,
    baseline_entries: list[str],
    deploy_copy: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Read as 0.0 it was "under its route timeout": a stream Envoy never resets was
    reported as one it resets first."""
    replace_once(deploy_copy / "envoy" / "envoy.yaml", line, disabled)
    for entry in baseline_entries:
        key = entry.split(":")[0]
        replace_once(deploy_copy / "baseline.yaml", entry, f"{key}: 0.0")
    assert check(deploy_copy) == 0, capsys.readouterr().out


def test_a_disabled_upstream_idle_timeout_breaks_the_keep_alive_rule(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Read as 0.0 it was "below the keep-alive" and passed; Envoy then never closes idle
    upstream connections, and the server's keep-alive closes them under it."""
    replace_once(deploy_copy / "envoy" / "envoy.yaml", UPSTREAM_IDLE, UPSTREAM_IDLE[:-3] + "0s")
    replace_once(
        deploy_copy / "baseline.yaml", "upstream_idle_timeout_s: 60.0", "upstream_idle_timeout_s: 0"
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for overlay in ("cpu", "gpu"):
        assert (
            f"k8s[{overlay}].envoy.upstream_idle_timeout_s: 0s disables it: Envoy never closes "
            "idle upstream connections, so the server's keep_alive_timeout_s (75) closes them"
            in out
        )
    assert out.count("\n") == 3, out  # the two overlays' lines and the summary


def test_a_disabled_route_timeout_lasts_as_long_as_the_server_allows_in_the_drain_check() -> None:
    """A route without Envoy's timeout counted as 0 s: a drain under the server's longest
    deadline passed it. (The server's own settings refuse such a drain too; built here
    without their validation to reach this rule.)"""
    envoy_text = (DEPLOY / "envoy" / "envoy.yaml").read_text()
    assert envoy_text.count(GENERATION_TIMEOUT) == 1
    envoy_text = envoy_text.replace(GENERATION_TIMEOUT, GENERATION_TIMEOUT.replace("60s", "0s"))
    settings = Settings.model_construct(drain_timeout_s=20.0, max_timeout_ms=60_000.0)
    overlay = OverlayValues(
        where="k8s[test]",
        settings=settings,
        k8s={"termination_grace_period_s": 100, "pre_stop_sleep_s": 10},
        envoy=read_envoy(yaml.safe_load(envoy_text)),
        probe_ports={},
        replica_inflight=1,
    )
    assert _check_shutdown(overlay) == [
        "k8s[test].settings.drain_timeout_s: 20.0 is under the longest Envoy route timeout "
        "(60.0): a request admitted just before SIGTERM may run that long, and the drain "
        "would cut it"
    ]
