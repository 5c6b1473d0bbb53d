"""`steadyserve check-config`: the deployed limits must equal deploy/baseline.yaml.

Three sources are read and compared with the baseline, value by value:

* the app's settings: `Settings()` (defaults + STEADY_* environment of this process) and, for
  each overlay under deploy/k8s/overlays, the settings a pod would get from its ConfigMap and
  container env;
* deploy/envoy/envoy.yaml (connection-reuse and buffer limits, retries, health checks, ...);
* the Kubernetes manifests rendered from each overlay (probes, grace period, resources, HPA).

Every difference is printed with both values, and the exit status is 1 if there is any. The
manifests are rendered by `render_kustomization`, a small kustomize that understands exactly
the subset the shipped kustomizations use and refuses anything else, so the files stay valid
for `kubectl kustomize` too (tests/deploy compares the two where kubectl exists).

Single-threaded command-line code; nothing here runs inside the server.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from app.settings import Settings

Manifest = dict[str, Any]

ENV_PREFIX = "STEADY_"
SERVER_DEPLOYMENT = "steadyserve"
SERVER_CONTAINER = "steadyserve"
ENVOY_CONFIG_MAP_PREFIX = "envoy-config"
ENVOY_CONFIG_KEY = "envoy.yaml"
INGRESS_LISTENER = "steadyserve_ingress"
UPSTREAM_CLUSTER = "steadyserve"
HCM_FILTER = "envoy.filters.network.http_connection_manager"
UPSTREAM_HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"


class ConfigError(Exception):
    """A file is missing, unreadable or uses something this checker does not understand."""


# --------------------------------------------------------------------------------------------
# A small kustomize: resources, configMapGenerator, strategic-merge patch files.
# --------------------------------------------------------------------------------------------

KUSTOMIZATION_FILENAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_KUSTOMIZATION_KEYS = frozenset(
    {"apiVersion", "kind", "resources", "configMapGenerator", "patches"}
)
SUPPORTED_GENERATOR_KEYS = frozenset({"name", "behavior", "literals", "files"})

# The patchMergeKey of the Kubernetes lists a strategic-merge patch merges instead of replacing
# (from the API's struct tags); every other list is replaced, as Kubernetes does.
STRATEGIC_MERGE_KEYS: Mapping[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "env": "name",
    "volumes": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "imagePullSecrets": "name",
}
POD_TEMPLATE_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "Job", "ReplicaSet"})


@dataclass
class _Layer:
    manifests: list[Manifest] = field(default_factory=list)
    # ConfigMaps made by a generator: their final name gets a content-hash suffix.
    generated: set[str] = field(default_factory=set)


def render_kustomization(directory: Path) -> list[Manifest]:
    """The manifests `kubectl kustomize directory` prints, as dicts, in resource order."""
    layer = _build_layer(directory.resolve())
    return _add_name_suffixes(layer)


def _load_kustomization(directory: Path) -> Mapping[str, Any]:
    for filename in KUSTOMIZATION_FILENAMES:
        path = directory / filename
        if path.is_file():
            loaded = yaml.safe_load(path.read_text())
            if not isinstance(loaded, dict):
                raise ConfigError(f"{path}: not a mapping")
            unsupported = set(loaded) - SUPPORTED_KUSTOMIZATION_KEYS
            if unsupported:
                raise ConfigError(f"{path}: unsupported kustomization fields {sorted(unsupported)}")
            return loaded
    raise ConfigError(f"{directory}: no kustomization file")


def _load_manifests(path: Path) -> list[Manifest]:
    try:
        documents = list(yaml.safe_load_all(path.read_text()))
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{path}: {error}") from error
    manifests: list[Manifest] = []
    for document in documents:
        if document is None:
            continue
        if not isinstance(document, dict) or "kind" not in document:
            raise ConfigError(f"{path}: a document is not a Kubernetes object")
        manifests.append(document)
    return manifests


def _build_layer(directory: Path) -> _Layer:
    kustomization = _load_kustomization(directory)
    layer = _Layer()
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            child = _build_layer(path)
            layer.manifests.extend(child.manifests)
            layer.generated |= child.generated
        else:
            layer.manifests.extend(_load_manifests(path))
    for generator in kustomization.get("configMapGenerator", []):
        _apply_config_map_generator(directory, generator, layer)
    for patch_entry in kustomization.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise ConfigError(f"{directory}: only `patches: - path: <file>` is supported")
        for patch in _load_manifests(directory / patch_entry["path"]):
            target = _find(layer.manifests, patch["kind"], patch["metadata"]["name"])
            if target is None:
                raise ConfigError(
                    f"{directory}: patch {patch_entry['path']} matches no "
                    f"{patch['kind']}/{patch['metadata']['name']}"
                )
            layer.manifests[layer.manifests.index(target)] = strategic_merge(target, patch)
    return layer


def _find(manifests: Iterable[Manifest], kind: str, name: str) -> Manifest | None:
    for manifest in manifests:
        if manifest.get("kind") == kind and manifest.get("metadata", {}).get("name") == name:
            return manifest
    return None


def _apply_config_map_generator(
    directory: Path, generator: Mapping[str, Any], layer: _Layer
) -> None:
    unsupported = set(generator) - SUPPORTED_GENERATOR_KEYS
    if unsupported:
        raise ConfigError(
            f"{directory}: unsupported configMapGenerator fields {sorted(unsupported)}"
        )
    name = str(generator["name"])
    data: dict[str, str] = {}
    for literal in generator.get("literals", []):
        key, separator, value = str(literal).partition("=")
        if not separator:
            raise ConfigError(f"{directory}: literal {literal!r} is not KEY=VALUE")
        data[key] = value
    for file_entry in generator.get("files", []):
        key, separator, relative = str(file_entry).partition("=")
        if not separator:
            key, relative = Path(file_entry).name, str(file_entry)
        data[key] = (directory / relative).read_text()
    behavior = generator.get("behavior", "create")
    existing = _find(layer.manifests, "ConfigMap", name)
    if behavior == "create":
        if existing is not None:
            raise ConfigError(f"{directory}: ConfigMap {name} already exists (use behavior: merge)")
        layer.manifests.append(
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data}
        )
        layer.generated.add(name)
    elif behavior in ("merge", "replace"):
        if existing is None or name not in layer.generated:
            raise ConfigError(f"{directory}: no generated ConfigMap {name} to {behavior}")
        merged = copy.deepcopy(existing)
        merged["data"] = {**existing.get("data", {}), **data} if behavior == "merge" else data
        layer.manifests[layer.manifests.index(existing)] = merged
    else:
        raise ConfigError(f"{directory}: unknown configMapGenerator behavior {behavior!r}")


def strategic_merge(base: Any, patch: Any, list_key: str | None = None) -> Any:
    """Kubernetes strategic-merge patch for built-in kinds: maps merge, `null` deletes a key,
    lists with a patchMergeKey (containers, env, ...) merge item by item, other lists replace."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            if value is None:
                merged.pop(key, None)
            elif key in merged:
                merged[key] = strategic_merge(merged[key], value, key)
            else:
                merged[key] = copy.deepcopy(value)
        return merged
    merge_key = STRATEGIC_MERGE_KEYS.get(list_key or "")
    if isinstance(base, list) and isinstance(patch, list) and merge_key is not None:
        result = [copy.deepcopy(item) for item in base]
        for item in patch:
            position = next(
                (i for i, old in enumerate(result) if old.get(merge_key) == item.get(merge_key)),
                None,
            )
            if position is None:
                result.append(copy.deepcopy(item))
            else:
                result[position] = strategic_merge(result[position], item)
        return result
    return copy.deepcopy(patch)


def _kustomize_hash_suffix(config_map: Manifest) -> str:
    """kustomize's name suffix: sha256 of the Go-JSON encoding of kind, name and data, the
    first 10 hex digits with 0, 1, 3, a, e swapped for letters (no accidental words/numbers).

    kustomize v5 looks the name up with a path that never matches ("metadata/name" as one
    key), so it hashes an empty name; doing the same keeps the names identical to its output.
    """
    encoded = json.dumps(
        {"data": config_map.get("data", {}), "kind": "ConfigMap", "name": ""},
        sort_keys=True,
        separators=(",", ":"),
        ensure_ascii=False,
    )
    # Go's encoding/json escapes these three; the hash is over Go's bytes.
    encoded = encoded.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _add_name_suffixes(layer: _Layer) -> list[Manifest]:
    renamed: dict[str, str] = {}
    manifests = copy.deepcopy(layer.manifests)
    for manifest in manifests:
        name = manifest["metadata"]["name"]
        if manifest["kind"] == "ConfigMap" and name in layer.generated:
            renamed[name] = f"{name}-{_kustomize_hash_suffix(manifest)}"
            manifest["metadata"]["name"] = renamed[name]
    for manifest in manifests:
        if manifest["kind"] in POD_TEMPLATE_KINDS:
            _rename_config_map_references(manifest["spec"]["template"]["spec"], renamed)
    return manifests


def _rename_config_map_references(pod_spec: Manifest, renamed: Mapping[str, str]) -> None:
    def rename(reference: Manifest | None) -> None:
        if reference is not None and reference.get("name") in renamed:
            reference["name"] = renamed[reference["name"]]

    for container in pod_spec.get("containers", []) + pod_spec.get("initContainers", []):
        for source in container.get("envFrom", []):
            rename(source.get("configMapRef"))
        for variable in container.get("env", []):
            rename(variable.get("valueFrom", {}).get("configMapKeyRef"))
    for volume in pod_spec.get("volumes", []):
        rename(volume.get("configMap"))
        for source in volume.get("projected", {}).get("sources", []):
            rename(source.get("configMap"))


# --------------------------------------------------------------------------------------------
# Reading values out of the sources.
# --------------------------------------------------------------------------------------------

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")
_CPU_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)(m?)$")


def _seconds(value: Any) -> Any:
    """A protobuf JSON duration ("0.25s") as float seconds; anything else unchanged."""
    if isinstance(value, str) and (match := _DURATION.match(value)):
        return float(match.group(1))
    return value


def _dig(node: Any, path: str) -> Any:
    """`a.b.0.c` into nested dicts and lists; None where any step is missing."""
    for step in path.split("."):
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


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
    route: Any
    cluster: Any
    upstream_http: Any


def _envoy_parts(config: Any) -> _EnvoyParts:
    resources = _dig(config, "static_resources")
    listener = _named(_dig(resources, "listeners"), INGRESS_LISTENER, "listener")
    hcm_filter = _named(_dig(listener, "filter_chains.0.filters"), HCM_FILTER, "listener filter")
    hcm = hcm_filter.get("typed_config")
    cluster = _named(_dig(resources, "clusters"), UPSTREAM_CLUSTER, "cluster")
    # The extension's name contains dots, so it cannot be a step of a `_dig` path.
    protocol_options = cluster.get("typed_extension_protocol_options") or {}
    return _EnvoyParts(
        config=config,
        listener=listener,
        hcm=hcm,
        route=_dig(hcm, "route_config.virtual_hosts.0.routes.0.route"),
        cluster=cluster,
        upstream_http=protocol_options.get(UPSTREAM_HTTP_OPTIONS),
    )


def _names(items: Any) -> Any:
    return None if items is None else [item.get("name") for item in items]


# Baseline key under `envoy:` -> how to read it from envoy.yaml.
ENVOY_FIELDS: Mapping[str, Callable[[_EnvoyParts], Any]] = {
    "admin_address": lambda p: _dig(p.config, "admin.address.socket_address.address"),
    "listener_per_connection_buffer_limit_bytes": lambda p: p.listener.get(
        "per_connection_buffer_limit_bytes"
    ),
    "downstream_max_requests_per_connection": lambda p: _dig(
        p.hcm, "common_http_protocol_options.max_requests_per_connection"
    ),
    "downstream_idle_timeout_s": lambda p: _dig(p.hcm, "common_http_protocol_options.idle_timeout"),
    "downstream_stream_idle_timeout_s": lambda p: _dig(p.hcm, "stream_idle_timeout"),
    "downstream_request_headers_timeout_s": lambda p: _dig(p.hcm, "request_headers_timeout"),
    "route_timeout_s": lambda p: _dig(p.route, "timeout"),
    "retry_on": lambda p: _dig(p.route, "retry_policy.retry_on"),
    "retriable_status_codes": lambda p: _dig(p.route, "retry_policy.retriable_status_codes"),
    "num_retries": lambda p: _dig(p.route, "retry_policy.num_retries"),
    "retry_host_predicates": lambda p: _names(_dig(p.route, "retry_policy.retry_host_predicate")),
    "rate_limited_retry_reset_headers": lambda p: _names(
        _dig(p.route, "retry_policy.rate_limited_retry_back_off.reset_headers")
    ),
    "rate_limited_retry_max_interval_s": lambda p: _dig(
        p.route, "retry_policy.rate_limited_retry_back_off.max_interval"
    ),
    "upstream_lb_policy": lambda p: p.cluster.get("lb_policy"),
    "upstream_connect_timeout_s": lambda p: p.cluster.get("connect_timeout"),
    "upstream_per_connection_buffer_limit_bytes": lambda p: p.cluster.get(
        "per_connection_buffer_limit_bytes"
    ),
    "upstream_max_requests_per_connection": lambda p: _dig(
        p.upstream_http, "common_http_protocol_options.max_requests_per_connection"
    ),
    "upstream_idle_timeout_s": lambda p: _dig(
        p.upstream_http, "common_http_protocol_options.idle_timeout"
    ),
    "circuit_breaker_max_connections": lambda p: _dig(
        p.cluster, "circuit_breakers.thresholds.0.max_connections"
    ),
    "circuit_breaker_max_requests": lambda p: _dig(
        p.cluster, "circuit_breakers.thresholds.0.max_requests"
    ),
    "circuit_breaker_max_pending_requests": lambda p: _dig(
        p.cluster, "circuit_breakers.thresholds.0.max_pending_requests"
    ),
    "retry_budget_percent": lambda p: _dig(
        p.cluster, "circuit_breakers.thresholds.0.retry_budget.budget_percent.value"
    ),
    "retry_budget_min_retry_concurrency": lambda p: _dig(
        p.cluster, "circuit_breakers.thresholds.0.retry_budget.min_retry_concurrency"
    ),
    "outlier_consecutive_5xx": lambda p: _dig(p.cluster, "outlier_detection.consecutive_5xx"),
    "outlier_consecutive_gateway_failure": lambda p: _dig(
        p.cluster, "outlier_detection.consecutive_gateway_failure"
    ),
    "outlier_base_ejection_time_s": lambda p: _dig(
        p.cluster, "outlier_detection.base_ejection_time"
    ),
    "outlier_max_ejection_percent": lambda p: _dig(
        p.cluster, "outlier_detection.max_ejection_percent"
    ),
    "health_check_path": lambda p: _dig(p.cluster, "health_checks.0.http_health_check.path"),
    "health_check_interval_s": lambda p: _dig(p.cluster, "health_checks.0.interval"),
    "health_check_timeout_s": lambda p: _dig(p.cluster, "health_checks.0.timeout"),
    "health_check_no_traffic_interval_s": lambda p: _dig(
        p.cluster, "health_checks.0.no_traffic_interval"
    ),
    "health_check_unhealthy_threshold": lambda p: _dig(
        p.cluster, "health_checks.0.unhealthy_threshold"
    ),
    "health_check_healthy_threshold": lambda p: _dig(
        p.cluster, "health_checks.0.healthy_threshold"
    ),
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


def _cpu_count(quantity: Any) -> int:
    """A CPU quantity ("4", "500m") rounded up to whole CPUs, as a divisor-1 resourceFieldRef."""
    match = _CPU_QUANTITY.match(str(quantity))
    if match is None:
        raise ConfigError(f"cannot read CPU quantity {quantity!r}")
    cpus = float(match.group(1)) / (1000 if match.group(2) else 1)
    return max(1, math.ceil(cpus))


def _probe(container: Any, probe: str) -> Any:
    return container.get(probe) or {}


def _server_parts(manifests: list[Manifest]) -> tuple[Manifest, Manifest]:
    deployment = _find(manifests, "Deployment", SERVER_DEPLOYMENT)
    if deployment is None:
        raise ConfigError(f"no Deployment {SERVER_DEPLOYMENT}")
    pod_spec = deployment["spec"]["template"]["spec"]
    return pod_spec, _named(pod_spec.get("containers"), SERVER_CONTAINER, "container")


# Baseline key under `k8s:` / `overlays.<name>.k8s:` -> how to read it from the manifests.
K8S_FIELDS: Mapping[str, Callable[[list[Manifest]], Any]] = {
    "termination_grace_period_s": lambda m: _server_parts(m)[0].get(
        "terminationGracePeriodSeconds"
    ),
    "pre_stop_sleep_s": lambda m: _dig(_server_parts(m)[1], "lifecycle.preStop.sleep.seconds"),
    "startup_probe_path": lambda m: _dig(_server_parts(m)[1], "startupProbe.httpGet.path"),
    "startup_probe_period_s": lambda m: _dig(_server_parts(m)[1], "startupProbe.periodSeconds"),
    "startup_probe_timeout_s": lambda m: _dig(_server_parts(m)[1], "startupProbe.timeoutSeconds"),
    "startup_probe_failure_threshold": lambda m: _dig(
        _server_parts(m)[1], "startupProbe.failureThreshold"
    ),
    "readiness_probe_path": lambda m: _dig(_server_parts(m)[1], "readinessProbe.httpGet.path"),
    "readiness_probe_period_s": lambda m: _dig(_server_parts(m)[1], "readinessProbe.periodSeconds"),
    "readiness_probe_timeout_s": lambda m: _dig(
        _server_parts(m)[1], "readinessProbe.timeoutSeconds"
    ),
    "readiness_probe_failure_threshold": lambda m: _dig(
        _server_parts(m)[1], "readinessProbe.failureThreshold"
    ),
    "liveness_probe_path": lambda m: _dig(_server_parts(m)[1], "livenessProbe.httpGet.path"),
    "liveness_probe_period_s": lambda m: _dig(_server_parts(m)[1], "livenessProbe.periodSeconds"),
    "liveness_probe_timeout_s": lambda m: _dig(_server_parts(m)[1], "livenessProbe.timeoutSeconds"),
    "liveness_probe_failure_threshold": lambda m: _dig(
        _server_parts(m)[1], "livenessProbe.failureThreshold"
    ),
    "run_as_non_root": lambda m: _dig(_server_parts(m)[0], "securityContext.runAsNonRoot"),
    "read_only_root_filesystem": lambda m: _dig(
        _server_parts(m)[1], "securityContext.readOnlyRootFilesystem"
    ),
    "capabilities_drop": lambda m: _dig(_server_parts(m)[1], "securityContext.capabilities.drop"),
    "cpu_request": lambda m: _dig(_server_parts(m)[1], "resources.requests.cpu"),
    "cpu_limit": lambda m: _dig(_server_parts(m)[1], "resources.limits.cpu"),
    "memory_limit": lambda m: _dig(_server_parts(m)[1], "resources.limits.memory"),
    "gpu_limit": lambda m: (_dig(_server_parts(m)[1], "resources.limits") or {}).get(
        "nvidia.com/gpu"
    ),
    "hpa_min_replicas": lambda m: _dig(
        _find(m, "HorizontalPodAutoscaler", "steadyserve"), "spec.minReplicas"
    ),
    "hpa_max_replicas": lambda m: _dig(
        _find(m, "HorizontalPodAutoscaler", "steadyserve"), "spec.maxReplicas"
    ),
    "hpa_cpu_utilization": lambda m: _hpa_metric(
        m, "Resource", "resource.target.averageUtilization"
    ),
    "hpa_inflight_per_pod": lambda m: _hpa_metric(m, "Pods", "pods.target.averageValue"),
    "pdb_max_unavailable": lambda m: _dig(
        _find(m, "PodDisruptionBudget", "steadyserve"), "spec.maxUnavailable"
    ),
}


def _hpa_metric(manifests: list[Manifest], metric_type: str, path: str) -> Any:
    hpa = _find(manifests, "HorizontalPodAutoscaler", "steadyserve")
    for metric in _dig(hpa, "spec.metrics") or []:
        if metric.get("type") == metric_type:
            return _dig(metric, path)
    return None


def read_k8s(manifests: list[Manifest]) -> dict[str, Any]:
    """Every `K8S_FIELDS` value of one rendered overlay."""
    return {key: read(manifests) for key, read in K8S_FIELDS.items()}


def pod_environment(manifests: list[Manifest]) -> dict[str, str]:
    """The STEADY_* environment the server container starts with: its ConfigMaps (envFrom),
    then its own env, with resourceFieldRef on limits.cpu resolved as the kubelet does."""
    _, container = _server_parts(manifests)
    environment: dict[str, str] = {}
    for source in container.get("envFrom", []):
        reference = source.get("configMapRef")
        if reference is None:
            continue
        config_map = _find(manifests, "ConfigMap", reference["name"])
        if config_map is None:
            raise ConfigError(f"envFrom names ConfigMap {reference['name']!r}, which is absent")
        environment.update({str(k): str(v) for k, v in config_map.get("data", {}).items()})
    for variable in container.get("env", []):
        if "value" in variable:
            environment[variable["name"]] = str(variable["value"])
        elif _dig(variable, "valueFrom.resourceFieldRef.resource") == "limits.cpu":
            if str(_dig(variable, "valueFrom.resourceFieldRef.divisor") or "1") != "1":
                raise ConfigError(f"{variable['name']}: only divisor 1 is understood")
            cpu_limit = _dig(container, "resources.limits.cpu")
            environment[variable["name"]] = str(_cpu_count(cpu_limit))
    return {key: value for key, value in environment.items() if key.startswith(ENV_PREFIX)}


class _EnvironmentFreeSettings(Settings):
    """Settings built only from the values passed in: what a pod gets, not what this process
    happens to have in its own environment."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)


def settings_from_environment(environment: Mapping[str, str]) -> tuple[Settings, list[str]]:
    """Settings from STEADY_* strings parsed the way pydantic-settings parses the environment
    (JSON for lists and objects); also the variables that name no setting (typos)."""
    values: dict[str, Any] = {}
    unknown: list[str] = []
    for name, raw in environment.items():
        field_name = name[len(ENV_PREFIX) :].lower()
        if field_name not in Settings.model_fields:
            unknown.append(name)
            continue
        values[field_name] = json.loads(raw) if raw.strip()[:1] in ("[", "{") else raw
    return _EnvironmentFreeSettings(**values), unknown


# --------------------------------------------------------------------------------------------
# Comparison.
# --------------------------------------------------------------------------------------------


def _normalise(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_normalise(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return value


def _show(value: Any) -> str:
    return "<absent>" if value is None else json.dumps(_normalise_for_display(value), default=str)


def _normalise_for_display(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def compare(where: str, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """One line per key of `expected` whose value differs in `actual`."""
    differences = []
    for key, want in expected.items():
        have = actual.get(key)
        if _normalise(want) != _normalise(have):
            differences.append(f"{where}.{key}: baseline {_show(want)}, actual {_show(have)}")
    return differences


def _settings_values(settings: Settings, keys: Iterable[str]) -> dict[str, Any]:
    return {key: getattr(settings, key) for key in keys}


@dataclass(frozen=True)
class Baseline:
    settings: Mapping[str, Any]
    envoy: Mapping[str, Any]
    k8s: Mapping[str, Any]
    overlays: Mapping[str, Mapping[str, Mapping[str, Any]]]

    @classmethod
    def load(cls, path: Path) -> Baseline:
        try:
            loaded = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as error:
            raise ConfigError(f"{path}: {error}") from error
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: not a mapping")
        baseline = cls(
            settings=loaded.get("settings") or {},
            envoy=loaded.get("envoy") or {},
            k8s=loaded.get("k8s") or {},
            overlays=loaded.get("overlays") or {},
        )
        baseline._check_keys(path)
        return baseline

    def _check_keys(self, path: Path) -> None:
        """A baseline key nobody reads would pass silently: refuse it."""
        problems = [
            f"settings.{key} is not a Settings field"
            for key in self.settings
            if key not in Settings.model_fields
        ]
        problems += [
            f"envoy.{key} is not read by check-config"
            for key in self.envoy
            if key not in ENVOY_FIELDS
        ]
        problems += [
            f"envoy.{key} is read by check-config but missing from the baseline"
            for key in ENVOY_FIELDS
            if key not in self.envoy
        ]
        for name, overlay in self.overlays.items():
            problems += [
                f"overlays.{name}.settings.{key} is not a Settings field"
                for key in overlay.get("settings", {})
                if key not in Settings.model_fields
            ]
            k8s_keys = {**self.k8s, **overlay.get("k8s", {})}
            problems += [
                f"overlays.{name}: k8s.{key} is not read by check-config"
                for key in k8s_keys
                if key not in K8S_FIELDS
            ]
            problems += [
                f"overlays.{name}: k8s.{key} is missing from the baseline"
                for key in K8S_FIELDS
                if key not in k8s_keys
            ]
        if problems:
            raise ConfigError(f"{path}: " + "; ".join(problems))


def check_envoy(baseline: Baseline, envoy_config: Any, where: str) -> list[str]:
    actual = read_envoy(envoy_config)
    expected = {**baseline.envoy, "deprecated_cluster_max_requests_per_connection": None}
    return compare(where, expected, actual)


def check_overlay(
    baseline: Baseline, name: str, manifests: list[Manifest], envoy_file_text: str
) -> list[str]:
    overlay = baseline.overlays[name]
    where = f"k8s[{name}]"
    environment = pod_environment(manifests)
    try:
        settings, unknown = settings_from_environment(environment)
    except ValidationError as error:
        return [f"{where}: the ConfigMap/env settings do not validate: {error}"]
    expected_settings = {**baseline.settings, **overlay.get("settings", {})}
    differences = compare(
        f"{where}.settings", expected_settings, _settings_values(settings, expected_settings)
    )
    differences += [f"{where}.settings: {variable} is not a setting" for variable in unknown]
    k8s_actual = read_k8s(manifests)
    differences += compare(where, {**baseline.k8s, **overlay.get("k8s", {})}, k8s_actual)

    envoy_config_maps = [
        m
        for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["name"].startswith(ENVOY_CONFIG_MAP_PREFIX)
    ]
    if len(envoy_config_maps) != 1:
        differences.append(f"{where}: expected one {ENVOY_CONFIG_MAP_PREFIX} ConfigMap")
    elif envoy_config_maps[0].get("data", {}).get(ENVOY_CONFIG_KEY) != envoy_file_text:
        differences.append(f"{where}: the Envoy ConfigMap differs from deploy/envoy/envoy.yaml")

    # Invariants between sources, which no single baseline value can express.
    grace = k8s_actual["termination_grace_period_s"] or 0
    pre_stop = k8s_actual["pre_stop_sleep_s"] or 0
    if grace <= pre_stop + settings.drain_timeout_s:
        differences.append(
            f"{where}.termination_grace_period_s: {grace} must exceed pre_stop_sleep_s "
            f"({pre_stop}) + drain_timeout_s ({settings.drain_timeout_s})"
        )
    return differences


def _default(setting: str) -> Any:
    return Settings.model_fields[setting].default


def check_invariants(baseline: Baseline, envoy_config: Any) -> list[str]:
    envoy = read_envoy(envoy_config)
    settings = baseline.settings
    differences = []
    route_timeout_s = envoy["route_timeout_s"]
    max_timeout_s = float(settings.get("max_timeout_ms", _default("max_timeout_ms"))) / 1000
    if isinstance(route_timeout_s, float) and route_timeout_s > max_timeout_s:
        differences.append(
            f"envoy.route_timeout_s: {route_timeout_s} exceeds the server's max_timeout_ms "
            f"({max_timeout_s * 1000:g}): the server would cut Envoy's deadline short"
        )
    keep_alive_s = float(settings.get("keep_alive_timeout_s", _default("keep_alive_timeout_s")))
    upstream_idle_s = envoy["upstream_idle_timeout_s"]
    if not isinstance(upstream_idle_s, float) or upstream_idle_s >= keep_alive_s:
        differences.append(
            f"envoy.upstream_idle_timeout_s: {upstream_idle_s} must be below the server's "
            f"keep_alive_timeout_s ({keep_alive_s:g}), or the server closes connections Envoy "
            "is about to reuse"
        )
    fleet_inflight = int(settings.get("max_inflight", 0)) * int(
        baseline.k8s.get("hpa_max_replicas", 0)
    )
    if envoy["circuit_breaker_max_requests"] != fleet_inflight:
        differences.append(
            f"envoy.circuit_breaker_max_requests: {envoy['circuit_breaker_max_requests']} is not "
            f"max_inflight x hpa_max_replicas ({fleet_inflight})"
        )
    return differences


def run_checks(baseline_path: Path, envoy_path: Path, k8s_path: Path) -> list[str]:
    """Every difference between the baseline and the shipped configuration, one line each."""
    baseline = Baseline.load(baseline_path)
    try:
        envoy_text = envoy_path.read_text()
        envoy_config = yaml.safe_load(envoy_text)
    except (OSError, yaml.YAMLError) as error:
        raise ConfigError(f"{envoy_path}: {error}") from error

    differences: list[str] = []
    try:
        process_settings = Settings()
    except ValidationError as error:
        differences.append(f"settings: Settings() does not validate: {error}")
    else:
        differences += compare(
            "settings", baseline.settings, _settings_values(process_settings, baseline.settings)
        )
    differences += check_envoy(baseline, envoy_config, "envoy")
    differences += check_invariants(baseline, envoy_config)

    overlays_dir = k8s_path / "overlays"
    found = (
        sorted(p.name for p in overlays_dir.iterdir() if p.is_dir())
        if overlays_dir.is_dir()
        else []
    )
    if found != sorted(baseline.overlays):
        differences.append(f"k8s.overlays: baseline {sorted(baseline.overlays)}, actual {found}")
    for name in sorted(set(found) & set(baseline.overlays)):
        try:
            manifests = render_kustomization(overlays_dir / name)
        except OSError as error:
            raise ConfigError(f"rendering overlay {name}: {error}") from error
        differences += check_overlay(baseline, name, manifests, envoy_text)
    return differences


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="steadyserve check-config",
        description="Compare settings, Envoy config and Kubernetes manifests with the baseline.",
    )
    parser.add_argument("--baseline", type=Path, default=Path("deploy/baseline.yaml"))
    parser.add_argument("--envoy", type=Path, default=Path("deploy/envoy/envoy.yaml"))
    parser.add_argument("--k8s", type=Path, default=Path("deploy/k8s"))
    arguments = parser.parse_args(argv)
    try:
        differences = run_checks(arguments.baseline, arguments.envoy, arguments.k8s)
    except ConfigError as error:
        sys.stderr.write(f"check-config: {error}\n")
        return 2
    for line in differences:
        sys.stdout.write(f"{line}\n")
    if differences:
        sys.stdout.write(
            f"check-config: {len(differences)} difference(s) from {arguments.baseline}\n"
        )
        return 1
    sys.stdout.write(f"check-config: configuration matches {arguments.baseline}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
