"""Reading the compared values out of envoy.yaml, rendered manifests and settings."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.checkconfig.common import (
    HCM_FILTER,
    INGRESS_LISTENER,
    SERVER_CONTAINER,
    SERVER_DEPLOYMENT,
    UPSTREAM_CLUSTER,
    UPSTREAM_HTTP_OPTIONS,
    ConfigError,
    Manifest,
    dig,
)
from app.checkconfig.kustomize import find_manifest

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")
_CPU_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")


def _seconds(value: Any) -> Any:
    """A protobuf JSON duration ("0.25s") as float seconds; anything else unchanged."""
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1))
    return value


def _named(items: Any, name: str, what: str) -> Any:
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    raise ConfigError(f"no {what} named {name!r}")


@dataclass(frozen=True)
class _EnvoyParts:
    config: Any
    listener: Any
    hcm: Any
    route: Any  # the catch-all route ("/")
    completions_route: Any
    chat_route: Any
    cluster: Any
    upstream_http: Any


def _envoy_parts(config: Any) -> _EnvoyParts:
    resources = dig(config, "static_resources")
    listener = _named(dig(resources, "listeners"), INGRESS_LISTENER, "listener")
    hcm_filter = _named(dig(listener, "filter_chains.0.filters"), HCM_FILTER, "listener filter")
    hcm = hcm_filter.get("typed_config")
    cluster = _named(dig(resources, "clusters"), UPSTREAM_CLUSTER, "cluster")
    # The extension's name contains dots, so it cannot be a step of a `_dig` path.
    protocol_options = cluster.get("typed_extension_protocol_options") or {}
    routes = dig(hcm, "route_config.virtual_hosts.0.routes") or []
    return _EnvoyParts(
        config=config,
        listener=listener,
        hcm=hcm,
        route=_route(routes, {"prefix": "/"}),
        completions_route=_route(routes, {"path": "/v1/completions"}),
        chat_route=_route(routes, {"path": "/v1/chat/completions"}),
        cluster=cluster,
        upstream_http=protocol_options.get(UPSTREAM_HTTP_OPTIONS),
    )


def _route(routes: list[Any], match: Mapping[str, str]) -> Any:
    """The route of the entry that matches exactly `match`; None if there is none."""
    for entry in routes:
        if isinstance(entry, dict) and entry.get("match") == match:
            return entry.get("route")
    return None


def _names(items: Any) -> Any:
    return None if items is None else [item.get("name") for item in items]


# Baseline key under `envoy:` -> how to read it from envoy.yaml.
ENVOY_FIELDS: Mapping[str, Callable[[_EnvoyParts], Any]] = {
    "admin_address": lambda p: dig(p.config, "admin.address.socket_address.address"),
    "listener_per_connection_buffer_limit_bytes": lambda p: p.listener.get(
        "per_connection_buffer_limit_bytes"
    ),
    "downstream_max_requests_per_connection": lambda p: dig(
        p.hcm, "common_http_protocol_options.max_requests_per_connection"
    ),
    "downstream_idle_timeout_s": lambda p: dig(p.hcm, "common_http_protocol_options.idle_timeout"),
    "downstream_stream_idle_timeout_s": lambda p: dig(p.hcm, "stream_idle_timeout"),
    "downstream_request_headers_timeout_s": lambda p: dig(p.hcm, "request_headers_timeout"),
    "route_timeout_s": lambda p: dig(p.route, "timeout"),
    "completions_route_timeout_s": lambda p: dig(p.completions_route, "timeout"),
    "chat_route_timeout_s": lambda p: dig(p.chat_route, "timeout"),
    # None where a route keeps the listener's stream idle timeout.
    "route_idle_timeout_s": lambda p: dig(p.route, "idle_timeout"),
    "completions_route_idle_timeout_s": lambda p: dig(p.completions_route, "idle_timeout"),
    "chat_route_idle_timeout_s": lambda p: dig(p.chat_route, "idle_timeout"),
    "retry_on": lambda p: dig(p.route, "retry_policy.retry_on"),
    "retriable_headers": lambda p: _names(dig(p.route, "retry_policy.retriable_headers")),
    "num_retries": lambda p: dig(p.route, "retry_policy.num_retries"),
    "retry_host_predicates": lambda p: _names(dig(p.route, "retry_policy.retry_host_predicate")),
    "rate_limited_retry_reset_headers": lambda p: _names(
        dig(p.route, "retry_policy.rate_limited_retry_back_off.reset_headers")
    ),
    "rate_limited_retry_max_interval_s": lambda p: dig(
        p.route, "retry_policy.rate_limited_retry_back_off.max_interval"
    ),
    "upstream_lb_policy": lambda p: p.cluster.get("lb_policy"),
    "upstream_connect_timeout_s": lambda p: p.cluster.get("connect_timeout"),
    "upstream_per_connection_buffer_limit_bytes": lambda p: p.cluster.get(
        "per_connection_buffer_limit_bytes"
    ),
    "upstream_max_requests_per_connection": lambda p: dig(
        p.upstream_http, "common_http_protocol_options.max_requests_per_connection"
    ),
    "upstream_idle_timeout_s": lambda p: dig(
        p.upstream_http, "common_http_protocol_options.idle_timeout"
    ),
    "circuit_breaker_max_connections": lambda p: dig(
        p.cluster, "circuit_breakers.thresholds.0.max_connections"
    ),
    "circuit_breaker_max_requests": lambda p: dig(
        p.cluster, "circuit_breakers.thresholds.0.max_requests"
    ),
    "circuit_breaker_max_pending_requests": lambda p: dig(
        p.cluster, "circuit_breakers.thresholds.0.max_pending_requests"
    ),
    "retry_budget_percent": lambda p: dig(
        p.cluster, "circuit_breakers.thresholds.0.retry_budget.budget_percent.value"
    ),
    "retry_budget_min_retry_concurrency": lambda p: dig(
        p.cluster, "circuit_breakers.thresholds.0.retry_budget.min_retry_concurrency"
    ),
    "outlier_consecutive_5xx": lambda p: dig(p.cluster, "outlier_detection.consecutive_5xx"),
    "outlier_consecutive_gateway_failure": lambda p: dig(
        p.cluster, "outlier_detection.consecutive_gateway_failure"
    ),
    "outlier_enforcing_consecutive_gateway_failure": lambda p: dig(
        p.cluster, "outlier_detection.enforcing_consecutive_gateway_failure"
    ),
    "outlier_base_ejection_time_s": lambda p: dig(
        p.cluster, "outlier_detection.base_ejection_time"
    ),
    "outlier_max_ejection_percent": lambda p: dig(
        p.cluster, "outlier_detection.max_ejection_percent"
    ),
    "health_check_path": lambda p: dig(p.cluster, "health_checks.0.http_health_check.path"),
    "health_check_interval_s": lambda p: dig(p.cluster, "health_checks.0.interval"),
    "health_check_timeout_s": lambda p: dig(p.cluster, "health_checks.0.timeout"),
    "health_check_no_traffic_interval_s": lambda p: dig(
        p.cluster, "health_checks.0.no_traffic_interval"
    ),
    "health_check_unhealthy_threshold": lambda p: dig(
        p.cluster, "health_checks.0.unhealthy_threshold"
    ),
    "health_check_healthy_threshold": lambda p: dig(p.cluster, "health_checks.0.healthy_threshold"),
}


def read_envoy(config: Any) -> dict[str, Any]:
    """The baseline's `envoy` values as configured in an envoy.yaml (already parsed)."""
    parts = _envoy_parts(config)
    values = {key: _seconds(read(parts)) for key, read in ENVOY_FIELDS.items()}
    # The deprecated cluster-level field would override nothing and hide a missing real one.
    values["deprecated_cluster_max_requests_per_connection"] = parts.cluster.get(
        "max_requests_per_connection"
    )
    return values


def cpu_count(quantity: Any) -> int:
    """A CPU quantity ("4", "500m") rounded up to whole CPUs, as a divisor-1 resourceFieldRef."""
    match = _CPU_QUANTITY.match(str(quantity))
    if match is None:
        raise ConfigError(f"cannot read CPU quantity {quantity!r}")
    cpus = float(match.group(1)) / (1000 if match.group(2) else 1)
    return max(1, math.ceil(cpus))


# Baseline key suffix -> path inside each of the server container's probes.
_PROBE_FIELDS = {
    "path": "httpGet.path",
    "period_s": "periodSeconds",
    "timeout_s": "timeoutSeconds",
    "failure_threshold": "failureThreshold",
}


def _container_field(path: str) -> Callable[[list[Manifest]], Any]:
    return lambda manifests: dig(server_parts(manifests)[1], path)


def server_parts(manifests: list[Manifest]) -> tuple[Manifest, Manifest]:
    deployment = find_manifest(manifests, "Deployment", SERVER_DEPLOYMENT)
    if deployment is None:
        raise ConfigError(f"no Deployment {SERVER_DEPLOYMENT}")
    pod_spec = dig(deployment, "spec.template.spec")
    if not isinstance(pod_spec, dict):
        raise ConfigError(f"Deployment {SERVER_DEPLOYMENT} has no spec.template.spec")
    return pod_spec, _named(pod_spec.get("containers"), SERVER_CONTAINER, "container")


def probe_ports(manifests: list[Manifest]) -> dict[str, Any]:
    """The port each of the server container's HTTP probes reaches, by probe, a named port
    resolved to its containerPort (None where it names none the container declares)."""
    container = server_parts(manifests)[1]
    named = {p.get("name"): p.get("containerPort") for p in container.get("ports") or []}
    ports: dict[str, Any] = {}
    for probe in ("startup", "readiness", "liveness"):
        port = dig(container, f"{probe}Probe.httpGet.port")
        if port is not None:
            ports[probe] = named.get(port) if isinstance(port, str) else port
    return ports


# Baseline key under `k8s:` / `overlays.<name>.k8s:` -> how to read it from the manifests.
K8S_FIELDS: Mapping[str, Callable[[list[Manifest]], Any]] = {
    "termination_grace_period_s": lambda m: server_parts(m)[0].get("terminationGracePeriodSeconds"),
    "pre_stop_sleep_s": lambda m: dig(server_parts(m)[1], "lifecycle.preStop.sleep.seconds"),
    **{
        f"{probe}_probe_{key}": _container_field(f"{probe}Probe.{path}")
        for probe in ("startup", "readiness", "liveness")
        for key, path in _PROBE_FIELDS.items()
    },
    "run_as_non_root": lambda m: dig(server_parts(m)[0], "securityContext.runAsNonRoot"),
    "read_only_root_filesystem": lambda m: dig(
        server_parts(m)[1], "securityContext.readOnlyRootFilesystem"
    ),
    "capabilities_drop": lambda m: dig(server_parts(m)[1], "securityContext.capabilities.drop"),
    "deployment_replicas": lambda m: dig(
        find_manifest(m, "Deployment", "steadyserve"), "spec.replicas"
    ),
    "envoy_replicas": lambda m: dig(
        find_manifest(m, "Deployment", "steadyserve-envoy"), "spec.replicas"
    ),
    "cpu_request": lambda m: dig(server_parts(m)[1], "resources.requests.cpu"),
    "memory_request": lambda m: dig(server_parts(m)[1], "resources.requests.memory"),
    "cpu_limit": lambda m: dig(server_parts(m)[1], "resources.limits.cpu"),
    "memory_limit": lambda m: dig(server_parts(m)[1], "resources.limits.memory"),
    "gpu_limit": lambda m: (dig(server_parts(m)[1], "resources.limits") or {}).get(
        "nvidia.com/gpu"
    ),
    "hpa_min_replicas": lambda m: dig(
        find_manifest(m, "HorizontalPodAutoscaler", "steadyserve"), "spec.minReplicas"
    ),
    "hpa_max_replicas": lambda m: dig(
        find_manifest(m, "HorizontalPodAutoscaler", "steadyserve"), "spec.maxReplicas"
    ),
    "hpa_cpu_utilization": lambda m: _hpa_metric(
        m, "Resource", "resource.target.averageUtilization"
    ),
    "hpa_inflight_per_pod": lambda m: _hpa_metric(m, "Pods", "pods.target.averageValue"),
    "pdb_max_unavailable": lambda m: dig(
        find_manifest(m, "PodDisruptionBudget", "steadyserve"), "spec.maxUnavailable"
    ),
}


def _hpa_metric(manifests: list[Manifest], metric_type: str, path: str) -> Any:
    hpa = find_manifest(manifests, "HorizontalPodAutoscaler", "steadyserve")
    for metric in dig(hpa, "spec.metrics") or []:
        if metric.get("type") == metric_type:
            return dig(metric, path)
    return None


def read_k8s(manifests: list[Manifest]) -> dict[str, Any]:
    """Every `K8S_FIELDS` value of one rendered overlay."""
    return {key: read(manifests) for key, read in K8S_FIELDS.items()}
