"""Relations between sources that no single baseline value expresses."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from app.checkconfig.baseline import Baseline
from app.checkconfig.envoy_config import read_envoy
from app.checkconfig.quantities import cpu_count, parse_quantity
from app.dispatcher import engine_thread_plan
from app.settings import Settings


def check_thread_budget(where: str, settings: Settings, cpu_limit: Any) -> list[str]:
    """Dispatcher threads x torch threads each must fit in the CPUs the engine gets, the CPU
    limit less the front ends' (a CPU each): more is the thread-starvation pattern of the
    incidents (CFS throttling as tail latency), between processes. Counts are the server's
    own: `engine_thread_plan` on the CPUs the limit gives the pod."""
    if cpu_limit is None:
        return [f"{where}.cpu_limit: none set; thread counts cannot be derived from it"]
    cpus = cpu_count(cpu_limit)
    plan = engine_thread_plan(settings, cpus)
    used = plan.compute_threads * plan.torch_intra_op
    if used <= plan.engine_cpus:
        return []
    frontends = settings.frontend_processes(cpus)
    return [
        f"{where}.threads: {plan.compute_threads} dispatcher threads x {plan.torch_intra_op} "
        f"torch threads = {used} exceed the engine's CPUs ({plan.engine_cpus}: the CPU limit "
        f"{cpus} less one for each of {frontends} front ends, at least one); leave "
        "STEADY_TORCH_THREADS unset (the server divides those CPUs among dispatcher threads), "
        "or lower it, STEADY_DISPATCHER_THREADS or STEADY_FRONTEND_WORKERS"
    ]


def _default(setting: str) -> Any:
    return Settings.model_fields[setting].default


def check_invariants(baseline: Baseline, envoy_config: Any) -> list[str]:
    envoy = read_envoy(envoy_config)
    settings = baseline.settings
    differences = []
    max_timeout_s = float(settings.get("max_timeout_ms", _default("max_timeout_ms"))) / 1000
    for key in ("route_timeout_s", "completions_route_timeout_s", "chat_route_timeout_s"):
        timeout_s = envoy[key]
        if isinstance(timeout_s, float) and timeout_s > max_timeout_s:
            differences.append(
                f"envoy.{key}: {timeout_s} exceeds the server's max_timeout_ms "
                f"({max_timeout_s * 1000:g}): the server would cut Envoy's deadline short"
            )
    listener_idle_s = envoy["downstream_stream_idle_timeout_s"]
    for route in ("route", "completions_route", "chat_route"):
        timeout_s, idle_s = envoy[f"{route}_timeout_s"], envoy[f"{route}_idle_timeout_s"]
        idle_s = listener_idle_s if idle_s is None else idle_s
        if isinstance(timeout_s, float) and isinstance(idle_s, float) and idle_s < timeout_s:
            differences.append(
                f"envoy.{route}_idle_timeout_s: {idle_s} (the stream idle timeout it gets) is "
                f"under its route timeout ({timeout_s}): an answer that sends nothing until it "
                "is done (a whole generation) is reset first"
            )
    keep_alive_s = float(settings.get("keep_alive_timeout_s", _default("keep_alive_timeout_s")))
    upstream_idle_s = envoy["upstream_idle_timeout_s"]
    if not isinstance(upstream_idle_s, float) or upstream_idle_s >= keep_alive_s:
        differences.append(
            f"envoy.upstream_idle_timeout_s: {upstream_idle_s} must be below the server's "
            f"keep_alive_timeout_s ({keep_alive_s:g}), or the server closes connections Envoy "
            "is about to reuse"
        )
    replicas = baseline.k8s.get("deployment_replicas")
    if replicas is not None and baseline.k8s.get("hpa_max_replicas") is not None:
        differences.append(
            f"k8s.deployment_replicas: {replicas} on the Deployment the HPA scales: every "
            "kubectl apply resets the replica count the HPA chose; leave it out"
        )
    differences += _check_circuit_breakers(baseline, envoy)
    return differences


def _check_circuit_breakers(baseline: Baseline, envoy: Mapping[str, Any]) -> list[str]:
    """Envoy holds no more than the fleet can serve within its delay budget, and answers the
    rest itself: what one replica holds x the most replicas there can be, shared among the
    Envoy pods (each enforces its own breakers: with 1024 each, two Envoys let in twice
    what the fleet can serve)."""
    replica_inflight = int(baseline.capacity["replica_inflight"])
    max_inflight = int(baseline.settings.get("max_inflight", _default("max_inflight")))
    envoys = max(1, int(baseline.k8s.get("envoy_replicas", 1)))
    fleet_inflight = replica_inflight * int(baseline.k8s.get("hpa_max_replicas", 0))
    per_envoy = fleet_inflight // envoys
    differences = []
    if replica_inflight > max_inflight:
        differences.append(
            f"capacity.replica_inflight: {replica_inflight} exceeds max_inflight "
            f"({max_inflight}), each front end's own cap: any one of a replica's front ends "
            "may hold all of its requests"
        )
    for key in ("circuit_breaker_max_requests", "circuit_breaker_max_connections"):
        if envoy[key] != per_envoy:
            differences.append(
                f"envoy.{key}: {envoy[key]} is not capacity.replica_inflight x "
                f"hpa_max_replicas / envoy_replicas ({per_envoy})"
            )
    target = baseline.k8s.get("hpa_inflight_per_pod")
    if target is not None and parse_quantity(target) >= replica_inflight:
        differences.append(
            f"k8s.hpa_inflight_per_pod: {target} is not under capacity.replica_inflight "
            f"({replica_inflight}): replicas would shed (and Envoy answer the overflow) before "
            "the HPA adds any"
        )
    pending = envoy["circuit_breaker_max_pending_requests"]
    if not isinstance(pending, int) or pending > replica_inflight:
        differences.append(
            f"envoy.circuit_breaker_max_pending_requests: {pending} exceeds "
            f"capacity.replica_inflight ({replica_inflight}): Envoy would queue more than a "
            "replica holds instead of answering the overflow"
        )
    return differences


def check_guaranteed_qos(where: str, k8s_actual: Mapping[str, Any]) -> list[str]:
    """Requests equal to limits for CPU and memory: Guaranteed QoS, and with it exclusive cores
    under the kubelet's static CPU manager. A missing request reads as the limit (sources.py,
    as Kubernetes sets it); a missing limit leaves the pod Burstable."""
    differences = []
    for resource in ("cpu", "memory"):
        request, limit = k8s_actual[f"{resource}_request"], k8s_actual[f"{resource}_limit"]
        if limit is None:
            differences.append(
                f"{where}.{resource}_limit: none set: Guaranteed QoS (exclusive cores under "
                "the static CPU manager) needs a limit, and requests == limits"
            )
        elif request is not None and parse_quantity(request) != parse_quantity(limit):
            differences.append(
                f"{where}.{resource}_request: {request} is not the limit ({limit}): Guaranteed "
                "QoS (exclusive cores under the static CPU manager) needs requests == limits"
            )
    return differences
