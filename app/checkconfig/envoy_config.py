"""Reading the compared values out of an envoy.yaml."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from app.checkconfig.common import (
    HCM_FILTER,
    INGRESS_LISTENER,
    UPSTREAM_CLUSTER,
    UPSTREAM_HTTP_OPTIONS,
    dig,
    named,
)
from app.checkconfig.envoy_routes import pick_routes, route_problems

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")


def _seconds(value: Any) -> Any:
    """A protobuf JSON duration ("0.25s") as float seconds; anything else unchanged."""
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1))
    return value


# A timeout Envoy does not apply: these fields' zero ("0s") disables it, never a zero-length
# timeout (route.proto RouteAction.timeout, "a value of 0 will disable the route's timeout",
# and idle_timeout; HttpConnectionManager.stream_idle_timeout; HttpProtocolOptions.idle_timeout,
# downstream and upstream). Infinite, so it is never under, and always over, a finite one.
DISABLED = math.inf
ZERO_DISABLES = frozenset(
    {
        "downstream_idle_timeout_s",
        "downstream_stream_idle_timeout_s",
        "route_timeout_s",
        "completions_route_timeout_s",
        "chat_route_timeout_s",
        "route_idle_timeout_s",
        "completions_route_idle_timeout_s",
        "chat_route_idle_timeout_s",
        "upstream_idle_timeout_s",
    }
)


def envoy_value(key: str, value: Any) -> Any:
    """An `envoy` value as Envoy applies it: DISABLED for a zero that disables the timeout
    (`ZERO_DISABLES`); used on envoy.yaml's values and the baseline's alike."""
    if key in ZERO_DISABLES and type(value) in (int, float) and value == 0:
        return DISABLED
    return value


@dataclass(frozen=True)
class _EnvoyParts:
    config: Any
    listener: Any
    hcm: Any
    # Each routed path's `route` action, from the entry Envoy picks for it.
    route: Any  # /infer's: the catch-all
    completions_route: Any
    chat_route: Any
    # The retry policy the catch-all applies (route_problems: every route applies the same).
    retry_policy: Any
    cluster: Any
    upstream_http: Any


def _envoy_parts(config: Any) -> _EnvoyParts:
    resources = dig(config, "static_resources")
    listener = named(dig(resources, "listeners"), INGRESS_LISTENER, "listener")
    hcm_filter = named(dig(listener, "filter_chains.0.filters"), HCM_FILTER, "listener filter")
    hcm = hcm_filter.get("typed_config")
    cluster = named(dig(resources, "clusters"), UPSTREAM_CLUSTER, "cluster")
    # The extension's name contains dots, so it cannot be a step of a `_dig` path.
    protocol_options = cluster.get("typed_extension_protocol_options") or {}
    picked = pick_routes(_virtual_host(hcm))
    routes = {name: route.route if route else None for name, route in picked.items()}
    catch_all = picked["route"]
    return _EnvoyParts(
        config=config,
        listener=listener,
        hcm=hcm,
        route=routes["route"],
        completions_route=routes["completions_route"],
        chat_route=routes["chat_route"],
        retry_policy=catch_all.retry_policy if catch_all else None,
        cluster=cluster,
        upstream_http=protocol_options.get(UPSTREAM_HTTP_OPTIONS),
    )


def _virtual_host(hcm: Any) -> Any:
    return dig(hcm, "route_config.virtual_hosts.0")


def _names(items: Any) -> Any:
    return None if items is None else [item.get("name") for item in items]


def _reset_headers(items: Any) -> Any:
    """Each header with its format, Envoy's default (SECONDS) where none is written."""
    if items is None:
        return None
    return [{"name": item.get("name"), "format": item.get("format", "SECONDS")} for item in items]


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
    "retry_on": lambda p: dig(p.retry_policy, "retry_on"),
    "retriable_status_codes": lambda p: dig(p.retry_policy, "retriable_status_codes"),
    # Header matchers compared whole: name and match kind.
    "retriable_headers": lambda p: dig(p.retry_policy, "retriable_headers"),
    "num_retries": lambda p: dig(p.retry_policy, "num_retries"),
    "retry_host_predicates": lambda p: _names(dig(p.retry_policy, "retry_host_predicate")),
    "retry_host_selection_max_attempts": lambda p: dig(
        p.retry_policy, "host_selection_retry_max_attempts"
    ),
    "rate_limited_retry_reset_headers": lambda p: _reset_headers(
        dig(p.retry_policy, "rate_limited_retry_back_off.reset_headers")
    ),
    "rate_limited_retry_max_interval_s": lambda p: dig(
        p.retry_policy, "rate_limited_retry_back_off.max_interval"
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
    "outlier_split_external_local_origin_errors": lambda p: dig(
        p.cluster, "outlier_detection.split_external_local_origin_errors"
    ),
    "outlier_consecutive_local_origin_failure": lambda p: dig(
        p.cluster, "outlier_detection.consecutive_local_origin_failure"
    ),
    "outlier_enforcing_consecutive_local_origin_failure": lambda p: dig(
        p.cluster, "outlier_detection.enforcing_consecutive_local_origin_failure"
    ),
    "outlier_enforcing_consecutive_5xx": lambda p: dig(
        p.cluster, "outlier_detection.enforcing_consecutive_5xx"
    ),
    "outlier_enforcing_consecutive_gateway_failure": lambda p: dig(
        p.cluster, "outlier_detection.enforcing_consecutive_gateway_failure"
    ),
    "outlier_enforcing_success_rate": lambda p: dig(
        p.cluster, "outlier_detection.enforcing_success_rate"
    ),
    "outlier_enforcing_local_origin_success_rate": lambda p: dig(
        p.cluster, "outlier_detection.enforcing_local_origin_success_rate"
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
    # None where the check goes to the traffic port (the endpoint's own).
    "health_check_port": lambda p: dig(
        p.cluster,
        "load_assignment.endpoints.0.lb_endpoints.0.endpoint.health_check_config.port_value",
    ),
}


def read_envoy(config: Any) -> dict[str, Any]:
    """The baseline's `envoy` values as configured in an envoy.yaml (already parsed)."""
    parts = _envoy_parts(config)
    values = {key: envoy_value(key, _seconds(read(parts))) for key, read in ENVOY_FIELDS.items()}
    # The deprecated cluster-level field would override nothing and hide a missing real one.
    values["deprecated_cluster_max_requests_per_connection"] = parts.cluster.get(
        "max_requests_per_connection"
    )
    return values


def envoy_route_problems(config: Any) -> list[str]:
    """Routes Envoy never reaches, and routes that retry differently (envoy_routes.py)."""
    return route_problems(_virtual_host(_envoy_parts(config).hcm))
