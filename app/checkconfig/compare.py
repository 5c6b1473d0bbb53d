"""Comparing every source with the baseline, and the command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import SettingsError

from app.checkconfig.common import ENVOY_CONFIG_KEY, ENVOY_CONFIG_MAP_PREFIX, ConfigError, Manifest
from app.checkconfig.envoy_config import ENVOY_FIELDS, envoy_route_problems, read_envoy
from app.checkconfig.kustomize import render_kustomization
from app.checkconfig.pod_settings import (
    describe_settings_error,
    pod_environment,
    settings_from_environment,
)
from app.checkconfig.sources import K8S_FIELDS, cpu_count, probe_ports, read_k8s
from app.dispatcher import engine_thread_plan
from app.settings import Settings


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
    # Measured capacity that other limits derive from (no file sets it directly).
    capacity: Mapping[str, Any]

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
            capacity=loaded.get("capacity") or {},
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
        problems += [
            f"capacity.{key} is not read by check-config"
            for key in self.capacity
            if key not in CAPACITY_FIELDS
        ]
        problems += [
            f"capacity.{key} is read by check-config but missing from the baseline"
            for key in CAPACITY_FIELDS
            if key not in self.capacity
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


# Baseline keys under `capacity:`.
CAPACITY_FIELDS = ("replica_inflight",)


def check_envoy(baseline: Baseline, envoy_config: Any, where: str) -> list[str]:
    actual = read_envoy(envoy_config)
    expected = {**baseline.envoy, "deprecated_cluster_max_requests_per_connection": None}
    return compare(where, expected, actual) + envoy_route_problems(envoy_config)


def check_overlay(
    baseline: Baseline, name: str, manifests: list[Manifest], envoy_file_text: str
) -> list[str]:
    overlay = baseline.overlays[name]
    where = f"k8s[{name}]"
    environment = pod_environment(manifests)
    try:
        settings, unknown = settings_from_environment(environment.variables)
    except ValidationError as error:
        return [f"{where}: the ConfigMap/env settings do not validate: {error}"]
    expected_settings = {**baseline.settings, **overlay.get("settings", {})}
    differences = compare(
        f"{where}.settings", expected_settings, _settings_values(settings, expected_settings)
    )
    differences += [f"{where}.settings: {variable} is not a setting" for variable in unknown]
    differences += [f"{where}.settings: {line}" for line in environment.unreadable]
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
    differences += _check_thread_budget(where, settings, k8s_actual["cpu_limit"])
    for resource in ("cpu", "memory"):
        request, limit = k8s_actual[f"{resource}_request"], k8s_actual[f"{resource}_limit"]
        if request != limit:
            differences.append(
                f"{where}.{resource}_request: {request} is not the limit ({limit}): Guaranteed "
                "QoS (exclusive cores under the static CPU manager) needs requests == limits"
            )
    # The probes must reach a port the server answers them on: its probe port when set.
    served = settings.health_port if settings.health_port is not None else settings.port
    for probe, port in probe_ports(manifests).items():
        if port != served:
            differences.append(
                f"{where}.{probe}_probe port: {port} is not the port the server answers "
                f"probes on ({served}: STEADY_HEALTH_PORT, else STEADY_PORT)"
            )
    routes = read_envoy(yaml.safe_load(envoy_file_text))
    longest_route_s = max(
        (t for k, t in routes.items() if k.endswith("route_timeout_s") and isinstance(t, float)),
        default=0.0,
    )
    if settings.drain_timeout_s < longest_route_s:
        differences.append(
            f"{where}.settings.drain_timeout_s: {settings.drain_timeout_s} is under the longest "
            f"Envoy route timeout ({longest_route_s}): a request admitted just before SIGTERM "
            "may run that long, and the drain would cut it"
        )
    grace = k8s_actual["termination_grace_period_s"] or 0
    pre_stop = k8s_actual["pre_stop_sleep_s"] or 0
    if grace <= pre_stop + settings.drain_timeout_s:
        differences.append(
            f"{where}.termination_grace_period_s: {grace} must exceed pre_stop_sleep_s "
            f"({pre_stop}) + drain_timeout_s ({settings.drain_timeout_s})"
        )
    return differences


def _check_thread_budget(where: str, settings: Settings, cpu_limit: Any) -> list[str]:
    """Dispatcher threads x torch threads each must fit in the CPU limit: more is the
    thread-starvation pattern of the incidents (CFS throttling as tail latency). Counts
    are the server's own: `engine_thread_plan` on the CPUs the limit gives the pod."""
    if cpu_limit is None:
        return [f"{where}.cpu_limit: none set; thread counts cannot be derived from it"]
    cpus = cpu_count(cpu_limit)
    plan = engine_thread_plan(settings, cpus)
    used = plan.compute_threads * plan.torch_intra_op
    if used <= cpus:
        return []
    return [
        f"{where}.threads: {plan.compute_threads} dispatcher threads x {plan.torch_intra_op} "
        f"torch threads = {used} exceed the CPU limit ({cpus}); leave STEADY_TORCH_THREADS "
        "unset (the server divides the limit among dispatcher threads) or lower it"
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
    if target is not None and float(target) >= replica_inflight:
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
    except SettingsError as error:
        # A STEADY_* variable of this process that cannot be parsed at all (not JSON for a
        # list setting): the server would not start either.
        raise ConfigError(f"this environment: {describe_settings_error(error)}") from error
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
            differences += check_overlay(baseline, name, manifests, envoy_text)
        except OSError as error:
            raise ConfigError(f"overlay {name}: {error}") from error
        except ConfigError as error:
            raise ConfigError(f"overlay {name}: {error}") from error
    return differences


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line `main` runs; SystemExit (status 2) on a usage error."""
    parser = argparse.ArgumentParser(
        prog="steadyserve check-config",
        description="Compare settings, Envoy config and Kubernetes manifests with the baseline.",
    )
    parser.add_argument("--baseline", type=Path, default=Path("deploy/baseline.yaml"))
    parser.add_argument("--envoy", type=Path, default=Path("deploy/envoy/envoy.yaml"))
    parser.add_argument("--k8s", type=Path, default=Path("deploy/k8s"))
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    arguments = parse_arguments(argv)
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
