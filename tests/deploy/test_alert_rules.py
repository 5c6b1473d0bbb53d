"""Alert rules: promtool checks and unit-tests deploy/prometheus/alerts.yaml, and the
PrometheusRule in deploy/k8s carries exactly the same groups."""

from __future__ import annotations

import shutil
from pathlib import Path

import yaml

from tests.deploy.test_grafana_dashboard import ENVOY_METRICS, metric_names
from tests.deploy.tools import DEPLOY, require_tool, run_tool
from tests.support.registry import exported_names

ALERTS = DEPLOY / "prometheus" / "alerts.yaml"
ALERTS_TEST = DEPLOY / "prometheus" / "alerts_test.yaml"
PROMETHEUS_RULE = DEPLOY / "k8s" / "base" / "prometheusrule.yaml"
REQUIRED_ALERTS = {
    "SteadyserveP99AboveSLO",
    "SteadyserveFastShareBelowObjective",
    "SteadyserveTimeToFirstTokenAboveObjective",
    "SteadyserveRejectingOverCapacity",
    "SteadyserveWarmupIncomplete",
    "SteadyserveEngineRestarting",
    "SteadyserveFrontendRestarting",
    "SteadyserveGpuClockLow",
    "SteadyserveGpuHot",
    "SteadyserveGpuReadingsLost",
    "EnvoyDownstreamConnectionsClosedWithActiveRequests",
    "EnvoyUpstreamConnectionsClosedWithActiveRequests",
    "EnvoyAnsweringOverCapacity",
}


def alert_names(groups: dict[str, object]) -> set[str]:
    return {
        rule["alert"]
        for group in groups["groups"]  # type: ignore[attr-defined]
        for rule in group["rules"]
        if "alert" in rule
    }


def test_promtool_checks_the_rule_file() -> None:
    result = run_tool(require_tool("promtool"), "check", "rules", str(ALERTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_prometheus_rule_spec_is_the_rule_file_and_passes_promtool(tmp_path: Path) -> None:
    spec = yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"]
    assert spec == yaml.safe_load(ALERTS.read_text())
    extracted = tmp_path / "prometheusrule-spec.yaml"
    extracted.write_text(yaml.safe_dump(spec))
    result = run_tool(require_tool("promtool"), "check", "rules", str(extracted))
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_required_alert_exists_and_is_unit_tested() -> None:
    assert alert_names(yaml.safe_load(ALERTS.read_text())) == REQUIRED_ALERTS
    tests = yaml.safe_load(ALERTS_TEST.read_text())["tests"]
    for scenario in tests:
        tested = {case["alertname"] for case in scenario["alert_rule_test"]}
        assert tested == REQUIRED_ALERTS, scenario["name"]
    firing = {
        case["alertname"]
        for scenario in tests
        for case in scenario["alert_rule_test"]
        if case["exp_alerts"]
    }
    assert firing == REQUIRED_ALERTS


def test_promtool_unit_tests_pass() -> None:
    result = run_tool(require_tool("promtool"), "test", "rules", str(ALERTS_TEST))
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_fail_when_a_threshold_moves(tmp_path: Path) -> None:
    """The unit tests above can fail: a GPU temperature threshold of 85 C misses the 80 C case."""
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    moved = ALERTS.read_text().replace(
        "steadyserve_gpu_temperature_celsius > 65", "steadyserve_gpu_temperature_celsius > 85"
    )
    assert moved != ALERTS.read_text()
    (tmp_path / ALERTS.name).write_text(moved)
    result = run_tool(require_tool("promtool"), "test", "rules", str(tmp_path / ALERTS_TEST.name))
    assert result.returncode != 0
    assert "SteadyserveGpuHot" in result.stdout + result.stderr


def test_alerts_use_only_names_the_server_exports() -> None:
    known = exported_names() | ENVOY_METRICS
    rules = [
        rule for group in yaml.safe_load(ALERTS.read_text())["groups"] for rule in group["rules"]
    ]
    used = {name for rule in rules for name in metric_names(rule["expr"])}
    assert "steadyserve_gpu_sm_clock_hertz" in used
    assert not used - known, sorted(used - known)


async def test_the_runbook_endpoint_exists() -> None:
    """The latency alert sends readers to GET /debug/slow: the app must answer there (401
    without the token, where a missing route would be 404)."""
    import httpx

    from app.main import create_app
    from app.settings import Settings

    assert "GET /debug/slow" in ALERTS.read_text()
    app = create_app(Settings(debug_token="runbook"))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        assert (await client.get("/debug/slow")).status_code == 401
        assert (await client.get("/debug/slower")).status_code == 404
