"""Reading the compared values out of the rendered Kubernetes manifests."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from app.checkconfig.common import (
    SERVER_CONTAINER,
    SERVER_DEPLOYMENT,
    ConfigError,
    Manifest,
    dig,
    named,
)
from app.checkconfig.kustomize import find_manifest

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
    return pod_spec, named(pod_spec.get("containers"), SERVER_CONTAINER, "container")


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


# Baseline keys whose values are Kubernetes quantities, compared as the amounts they stand for.
QUANTITY_FIELDS = frozenset(
    {"cpu_request", "memory_request", "cpu_limit", "memory_limit", "gpu_limit"}
    | {"hpa_inflight_per_pod"}
)

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
    "cpu_request": lambda m: _request(server_parts(m)[1], "cpu"),
    "memory_request": lambda m: _request(server_parts(m)[1], "memory"),
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


def _request(container: Manifest, resource: str) -> Any:
    """The request Kubernetes gives the container: the one written, else its limit."""
    request = dig(container, f"resources.requests.{resource}")
    return request if request is not None else dig(container, f"resources.limits.{resource}")


def _hpa_metric(manifests: list[Manifest], metric_type: str, path: str) -> Any:
    hpa = find_manifest(manifests, "HorizontalPodAutoscaler", "steadyserve")
    for metric in dig(hpa, "spec.metrics") or []:
        if metric.get("type") == metric_type:
            return dig(metric, path)
    return None


def read_k8s(manifests: list[Manifest]) -> dict[str, Any]:
    """Every `K8S_FIELDS` value of one rendered overlay."""
    return {key: read(manifests) for key, read in K8S_FIELDS.items()}
