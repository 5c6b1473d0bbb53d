"""deploy/grafana/steadyserve.json: every query is valid PromQL (promtool) and uses only
metric names the server's registry exports (docs/ARCHITECTURE.md §5) and the Envoy stats the
alerts use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.tools import DEPLOY, require_tool, run_tool
from tests.support.registry import exported_names

DASHBOARD = DEPLOY / "grafana" / "steadyserve.json"
# Envoy's own stats, which the alerts use too (each checked against what a real Envoy running
# the shipped config exports: tests/deploy/test_envoy_config.py::
# test_stats_listener_exposes_only_metrics_and_readiness); every steadyserve name comes from
# the server's registry.
ENVOY_METRICS = {
    "envoy_http_downstream_cx_destroy_local_active_rq",
    "envoy_cluster_upstream_cx_destroy_local_with_active_rq",
    "envoy_cluster_upstream_cx_total",
    "envoy_cluster_upstream_cx_max_requests",
    "envoy_http_downstream_cx_total",
    "envoy_cluster_upstream_rq_retry",
    "envoy_cluster_upstream_rq_retry_overflow",
    "envoy_cluster_upstream_rq_pending_overflow",
    "envoy_http_downstream_rq_total",
}
REQUIRED_PANELS = {
    "Request latency percentiles (answered requests)",
    "Throughput by outcome",
    "Rejections by reason",
    "Queue depth and its high-water mark",
    "Batch size",
    "Buffer-pool slots in use",
    "SM clock",
    "Temperature",
}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def queries() -> list[tuple[str, str]]:
    return [
        (panel["title"], target["expr"])
        for panel in dashboard()["panels"]
        for target in panel.get("targets", [])
    ]


def as_promql(expr: str) -> str:
    """Grafana's interval variable is not PromQL; any valid range stands in for it."""
    return expr.replace("$__rate_interval", "1m")


def test_required_panels_exist_with_queries() -> None:
    titles = {panel["title"] for panel in dashboard()["panels"] if panel.get("targets")}
    assert titles >= REQUIRED_PANELS


def test_every_query_is_valid_promql(tmp_path: Path) -> None:
    rules = {
        "groups": [
            {
                "name": "dashboard",
                "rules": [
                    {"record": f"dashboard:query_{i}", "expr": as_promql(expr)}
                    for i, (_, expr) in enumerate(queries())
                ],
            }
        ]
    }
    path = tmp_path / "dashboard-queries.yaml"
    path.write_text(yaml.safe_dump(rules))
    result = run_tool(require_tool("promtool"), "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr


def metric_names(expr: str) -> list[str]:
    """Names in metric position: label matchers and grouping labels removed first."""
    without_labels = re.sub(r"\{[^}]*\}|\b(?:by|without)\s*\([^)]*\)", "", expr)
    return re.findall(r"\b(?:steadyserve|envoy)_[a-z0-9_]+", without_labels)


def test_queries_use_only_names_the_server_exports() -> None:
    known = exported_names() | ENVOY_METRICS
    used = set()
    for title, expr in queries():
        for name in metric_names(expr):
            assert name in known, (title, name)
            used.add(name)
    # The check can fail: the GPU and allocator panels query names the registry must have.
    assert {"steadyserve_gpu_sm_clock_hertz", "steadyserve_cuda_alloc_retries_total"} <= used


def test_metric_name_check_catches_a_misspelt_name() -> None:
    assert metric_names("rate(steadyserve_gpu_sm_clock_hz[1m])")[0] not in exported_names()
