"""deploy/grafana/steadyserve.json: every query is valid PromQL (promtool) and uses only the
metric names of the contract (docs/ARCHITECTURE.md §5) and the Envoy stats the alerts use."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.tools import DEPLOY, require_tool, run_tool

DASHBOARD = DEPLOY / "grafana" / "steadyserve.json"
CONTRACT_METRICS = {
    "steadyserve_request_duration_seconds",
    "steadyserve_admission_wait_seconds",
    "steadyserve_queue_wait_seconds",
    "steadyserve_batch_size",
    "steadyserve_batch_compute_seconds",
    "steadyserve_rejected_total",
    "steadyserve_inflight_requests",
    "steadyserve_queue_depth",
    "steadyserve_queue_depth_max",
    "steadyserve_pool_slots",
    "steadyserve_pool_slots_in_use",
    "steadyserve_pool_acquire_wait_seconds",
    "steadyserve_pool_misses_total",
    "steadyserve_pool_bytes",
    "steadyserve_warmup_shapes",
    "steadyserve_warmup_shapes_done",
    "steadyserve_gpu_sm_clock_hertz",
    "steadyserve_gpu_temperature_celsius",
    "steadyserve_gpu_power_watts",
    "steadyserve_gpu_throttle_reasons",
    "steadyserve_gpu_memory_used_bytes",
    "steadyserve_gpu_memory_free_bytes",
    "steadyserve_cuda_allocator_reserved_bytes",
    "steadyserve_cuda_allocator_allocated_bytes",
    "steadyserve_cuda_allocator_largest_free_block_bytes",
    "steadyserve_cuda_alloc_retries_total",
    "steadyserve_cuda_context_changes_total",
    "envoy_http_downstream_cx_destroy_local_active_rq",
    "envoy_cluster_upstream_cx_destroy_local_with_active_rq",
    "envoy_cluster_upstream_cx_total",
    "envoy_cluster_upstream_cx_max_requests",
    "envoy_http_downstream_cx_total",
    "envoy_cluster_upstream_rq_retry",
    "envoy_cluster_upstream_rq_retry_overflow",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
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


def test_queries_use_only_contract_metric_names() -> None:
    for title, expr in queries():
        for name in metric_names(expr):
            base = next((name[: -len(s)] for s in HISTOGRAM_SUFFIXES if name.endswith(s)), name)
            assert name in CONTRACT_METRICS or base in CONTRACT_METRICS, (title, name)
