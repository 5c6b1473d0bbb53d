"""Relations between sources that no single baseline value expresses, each evaluated on the
values one overlay really deploys: its pod's settings, its rendered manifests and its Envoy
ConfigMap. An overlay that changes one side of a relation (more replicas, another keep-alive)
is checked against the other side, not against the baseline's shared values."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.checkconfig.common import ConfigError
from app.checkconfig.envoy_config import DISABLED
from app.checkconfig.quantities import cpu_count, parse_quantity
from app.dispatcher import engine_thread_plan
from app.drain import STOP_MARGIN_S
from app.settings import Settings

# The routes read out of envoy.yaml (envoy_config.ENVOY_FIELDS' `<route>_timeout_s`).
_ROUTES = ("route", "completions_route", "chat_route")


@dataclass(frozen=True)
class OverlayValues:
    """What one rendered overlay deploys, as the relations below read it."""

    # Where its lines are reported: `k8s[<overlay>]`.
    where: str
    # The settings its server container gets (pod_settings).
    settings: Settings
    # Every K8S_FIELDS value of its manifests (sources.read_k8s).
    k8s: Mapping[str, Any]
    # Every ENVOY_FIELDS value of its Envoy ConfigMap (envoy_config.read_envoy).
    envoy: Mapping[str, Any]
    # The port each of the server container's probes reaches (sources.probe_ports).
    probe_ports: Mapping[str, Any]
    # capacity.replica_inflight: measured, so the baseline's (no file sets it).
    replica_inflight: int
    # capacity.replica_resident_mb and frontend_resident_mb: measured, so the baseline's;
    # None: not checked.
    resident_mb: tuple[float, float] | None = None


def check_overlay_invariants(overlay: OverlayValues) -> list[str]:
    """One line per relation the overlay's own values break."""
    return (
        check_thread_budget(overlay.where, overlay.settings, overlay.k8s["cpu_limit"])
        + check_guaranteed_qos(overlay.where, overlay.k8s)
        + _check_server_against_envoy(overlay)
        + _check_shutdown(overlay)
        + _check_replicas(overlay)
        + _check_circuit_breakers(overlay)
        + _check_memory(overlay)
    )


def check_envoy_invariants(envoy: Mapping[str, Any]) -> list[str]:
    """Envoy's own relations (`envoy` as read_envoy reads it): each route's stream idle
    timeout not under its route timeout. A disabled idle timeout (DISABLED) is under none; a
    disabled route timeout is reported with the server's settings (_check_server_against_envoy)."""
    differences = []
    listener_idle_s = envoy["downstream_stream_idle_timeout_s"]
    for route in _ROUTES:
        timeout_s, idle_s = envoy[f"{route}_timeout_s"], envoy[f"{route}_idle_timeout_s"]
        idle_s = listener_idle_s if idle_s is None else idle_s
        if timeout_s == DISABLED:
            continue
        if isinstance(timeout_s, float) and isinstance(idle_s, float) and idle_s < timeout_s:
            differences.append(
                f"envoy.{route}_idle_timeout_s: {idle_s} (the stream idle timeout it gets) is "
                f"under its route timeout ({timeout_s}): an answer that sends nothing until it "
                "is done (a whole generation) is reset first"
            )
    return differences


def _check_server_against_envoy(overlay: OverlayValues) -> list[str]:
    """Envoy's deadlines within what the server allows, its idle upstream connections closed
    before the server's keep-alive closes them, the probes on the port the server answers."""
    where, settings, envoy = overlay.where, overlay.settings, overlay.envoy
    differences = []
    max_timeout_s = settings.max_timeout_ms / 1000
    for route in _ROUTES:
        timeout_s = envoy[f"{route}_timeout_s"]
        if timeout_s == DISABLED:
            differences.append(
                f"{where}.envoy.{route}_timeout_s: 0s disables Envoy's route timeout: Envoy "
                "then sends no x-envoy-expected-rq-timeout-ms, so a request without its own "
                f"timeout_ms gets the server's default_timeout_ms ({settings.default_timeout_ms:g})"
                " and is answered 504 then (a long stream cut short), and Envoy waits on a "
                "replica that stops answering forever; set a timeout, at most max_timeout_ms "
                f"({settings.max_timeout_ms:g})"
            )
        elif isinstance(timeout_s, float) and timeout_s > max_timeout_s:
            differences.append(
                f"{where}.envoy.{route}_timeout_s: {timeout_s} exceeds the server's "
                f"max_timeout_ms ({settings.max_timeout_ms:g}): the server would cut Envoy's "
                "deadline short"
            )
    keep_alive_s = settings.keep_alive_timeout_s
    upstream_idle_s = envoy["upstream_idle_timeout_s"]
    if upstream_idle_s == DISABLED:
        differences.append(
            f"{where}.envoy.upstream_idle_timeout_s: 0s disables it: Envoy never closes idle "
            f"upstream connections, so the server's keep_alive_timeout_s ({keep_alive_s:g}) "
            "closes them, and Envoy may send a request on one it is closing; set it below "
            "the keep-alive"
        )
    elif not isinstance(upstream_idle_s, float) or upstream_idle_s >= keep_alive_s:
        differences.append(
            f"{where}.envoy.upstream_idle_timeout_s: {upstream_idle_s} must be below the "
            f"server's keep_alive_timeout_s ({keep_alive_s:g}), or the server closes "
            "connections Envoy is about to reuse"
        )
    served = settings.health_port if settings.health_port is not None else settings.port
    for probe, port in overlay.probe_ports.items():
        if port != served:
            differences.append(
                f"{where}.{probe}_probe port: {port} is not the port the server answers "
                f"probes on ({served}: STEADY_HEALTH_PORT, else STEADY_PORT)"
            )
    checked = envoy["health_check_port"]
    if settings.health_port is not None and checked != settings.health_port:
        differences.append(
            f"{where}.envoy.health_check_port: {checked} is not the probe port "
            f"({settings.health_port}, STEADY_HEALTH_PORT): Envoy's health check would wait "
            "behind the traffic (None: the traffic port) or find nothing there"
        )
    return differences


def _check_shutdown(overlay: OverlayValues) -> list[str]:
    """The drain outlasts the longest route, and the grace period preStop, the drain and
    the server's stop after it."""
    where, drain_s, k8s = overlay.where, overlay.settings.drain_timeout_s, overlay.k8s
    differences = []
    # A route without Envoy's timeout runs as long as the server lets a request: at most
    # max_timeout_ms (a request's own timeout_ms, else default_timeout_ms, is capped there).
    max_timeout_s = overlay.settings.max_timeout_ms / 1000
    longest_route_s = max(
        (
            max_timeout_s if t == DISABLED else t
            for t in (overlay.envoy[f"{r}_timeout_s"] for r in _ROUTES)
            if isinstance(t, float)
        ),
        default=0.0,
    )
    if drain_s < longest_route_s:
        differences.append(
            f"{where}.settings.drain_timeout_s: {drain_s} is under the longest Envoy route "
            f"timeout ({longest_route_s}): a request admitted just before SIGTERM may run that "
            "long, and the drain would cut it"
        )
    grace = k8s["termination_grace_period_s"] or 0
    pre_stop = k8s["pre_stop_sleep_s"] or 0
    if grace <= pre_stop + drain_s + STOP_MARGIN_S:
        differences.append(
            f"{where}.termination_grace_period_s: {grace} must exceed pre_stop_sleep_s "
            f"({pre_stop}) + drain_timeout_s ({drain_s}) + the server's {STOP_MARGIN_S:g} s "
            "to stop its processes after the drain"
        )
    return differences


def _check_replicas(overlay: OverlayValues) -> list[str]:
    replicas = overlay.k8s["deployment_replicas"]
    if replicas is None or overlay.k8s["hpa_max_replicas"] is None:
        return []
    return [
        f"{overlay.where}.deployment_replicas: {replicas} on the Deployment the HPA scales: "
        "every kubectl apply resets the replica count the HPA chose; leave it out"
    ]


def _count(overlay: OverlayValues, key: str, absent: int) -> int:
    """A replica count of the manifests: `absent` (Kubernetes' default) where none is set."""
    value = overlay.k8s[key]
    if value is None:
        return absent
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{overlay.where}.{key}: {value!r} is not a whole number")
    return value


def _check_circuit_breakers(overlay: OverlayValues) -> list[str]:
    """Envoy holds no more than the fleet can serve within its delay budget, and answers the
    rest itself: what one replica holds x the most replicas there can be (the HPA's maximum,
    else the Deployment's count), shared among the Envoy pods (each enforces its own
    breakers: with 1024 each, two Envoys let in twice what the fleet can serve)."""
    where, envoy, replica_inflight = overlay.where, overlay.envoy, overlay.replica_inflight
    max_inflight = overlay.settings.max_inflight
    envoys = max(1, _count(overlay, "envoy_replicas", 1))
    replicas = _count(overlay, "hpa_max_replicas", _count(overlay, "deployment_replicas", 1))
    per_envoy = replica_inflight * replicas // envoys
    differences = []
    if replica_inflight > max_inflight:
        differences.append(
            f"{where}.capacity.replica_inflight: {replica_inflight} exceeds max_inflight "
            f"({max_inflight}), each front end's own cap: any one of a replica's front ends "
            "may hold all of its requests"
        )
    for key in ("circuit_breaker_max_requests", "circuit_breaker_max_connections"):
        if envoy[key] != per_envoy:
            differences.append(
                f"{where}.envoy.{key}: {envoy[key]} is not capacity.replica_inflight x "
                f"hpa_max_replicas / envoy_replicas ({per_envoy})"
            )
    target = overlay.k8s["hpa_inflight_per_pod"]
    if target is not None and parse_quantity(target) >= replica_inflight:
        differences.append(
            f"{where}.hpa_inflight_per_pod: {target} is not under capacity.replica_inflight "
            f"({replica_inflight}): replicas would shed (and Envoy answer the overflow) before "
            "the HPA adds any"
        )
    pending = envoy["circuit_breaker_max_pending_requests"]
    if not isinstance(pending, int) or pending > replica_inflight:
        differences.append(
            f"{where}.envoy.circuit_breaker_max_pending_requests: {pending} exceeds "
            f"capacity.replica_inflight ({replica_inflight}): Envoy would queue more than a "
            "replica holds instead of answering the overflow"
        )
    return differences


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


def _check_memory(overlay: OverlayValues) -> list[str]:
    """A CPU replica's memory limit holds what its processes were measured to hold (the
    baseline's `capacity`: one front end, and each further one) and the bodies of every
    request Envoy can have at it at once (each Envoy pod's `max_connections`, one request a
    connection over HTTP/1.1, should all land on it), each held twice at worst (as read and
    as parsed text); and it is at most twice that: with requests equal to limits the pod
    reserves it whole on its node. The figures were measured on CPU: a GPU replica's host
    memory (CUDA context, pinned buffers, larger models) is not held to them."""
    settings, k8s, envoy = overlay.settings, overlay.k8s, overlay.envoy
    limit, cpu_limit = k8s["memory_limit"], k8s["cpu_limit"]
    connections = envoy["circuit_breaker_max_connections"]
    if overlay.resident_mb is None or settings.device != "cpu" or None in (limit, cpu_limit):
        return []
    if isinstance(connections, bool) or not isinstance(connections, int):
        return []  # reported with the circuit breakers
    first_mb, each_more_mb = overlay.resident_mb
    frontends = settings.frontend_processes(cpu_count(cpu_limit))
    processes = (first_mb + each_more_mb * (frontends - 1)) * 10**6
    bodies = (
        2 * settings.max_body_bytes * connections * max(1, _count(overlay, "envoy_replicas", 1))
    )
    budget = processes + bodies
    amount = parse_quantity(limit)
    said = (
        f"{processes / 2**30:.2f} GiB for the engine and {frontends} front ends, measured, "
        f"+ {bodies / 2**30:.2f} GiB of request bodies"
    )
    if amount < budget:
        return [
            f"{overlay.where}.memory_limit: {limit} is under what a replica can hold "
            f"({budget / 2**30:.2f} GiB: {said}): a flood's bodies would get it OOM-killed"
        ]
    if amount > 2 * budget:
        return [
            f"{overlay.where}.memory_limit: {limit} is more than twice what a replica can hold "
            f"({budget / 2**30:.2f} GiB: {said}): Guaranteed QoS reserves it all on its node"
        ]
    return []
