"""Comparing every source with the baseline, and the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from pydantic_settings import SettingsError

from app.checkconfig.baseline import Baseline
from app.checkconfig.common import ENVOY_CONFIG_KEY, ENVOY_CONFIG_MAP_PREFIX, ConfigError, Manifest
from app.checkconfig.envoy_config import DISABLED, envoy_route_problems, envoy_value, read_envoy
from app.checkconfig.invariants import (
    OverlayValues,
    check_envoy_invariants,
    check_overlay_invariants,
)
from app.checkconfig.kustomize import render_kustomization
from app.checkconfig.pod_settings import (
    describe_settings_error,
    describe_validation_error,
    pod_environment,
    pod_setting_fields,
    settings_from_environment,
)
from app.checkconfig.quantities import same_quantity
from app.checkconfig.sources import QUANTITY_FIELDS, probe_ports, read_k8s
from app.settings import Settings

# The overlay a deploy tree without overlays is checked as: its base (`k8s[base]`).
BASE_ONLY = "base"


def _normalise(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return [_normalise(item) for item in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int | float):
        return float(value)
    return value


def _show(value: Any) -> str:
    if value is None:
        return "<absent>"
    if value == DISABLED:
        return "0s (disabled)"
    return json.dumps(_normalise_for_display(value), default=str)


def _normalise_for_display(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def compare(where: str, expected: Mapping[str, Any], actual: Mapping[str, Any]) -> list[str]:
    """One line per key of `expected` whose value differs in `actual`; quantities ("4",
    "4000m") by the amount they stand for."""
    differences = []
    for key, want in expected.items():
        have = actual.get(key)
        if key in QUANTITY_FIELDS:
            try:
                same = same_quantity(want, have)
            except ConfigError as error:
                raise ConfigError(f"{where}.{key}: {error}") from error
        else:
            same = _normalise(want) == _normalise(have)
        if not same:
            differences.append(f"{where}.{key}: baseline {_show(want)}, actual {_show(have)}")
    return differences


def _settings_values(settings: Settings, keys: Iterable[str]) -> dict[str, Any]:
    return {key: getattr(settings, key) for key in keys}


def check_envoy(baseline: Baseline, envoy_config: Any, where: str) -> list[str]:
    actual = read_envoy(envoy_config)
    # A baseline's 0 for a timeout Envoy disables at zero means that: no timeout.
    expected = {key: envoy_value(key, value) for key, value in baseline.envoy.items()}
    expected["deprecated_cluster_max_requests_per_connection"] = None
    return compare(where, expected, actual) + envoy_route_problems(envoy_config)


def check_overlay(
    baseline: Baseline, name: str, manifests: list[Manifest], envoy_file_text: str
) -> list[str]:
    overlay = baseline.overlays.get(name, {})  # none for BASE_ONLY
    where = f"k8s[{name}]"
    environment = pod_environment(manifests)
    try:
        settings, unknown = settings_from_environment(environment.variables, environment.overrides)
    except ValidationError as error:
        # The server would not start: a config error (run_checks names the overlay).
        described = describe_validation_error(error, environment.variables, environment)
        raise ConfigError(described) from error
    expected_settings = {**baseline.settings, **overlay.get("settings", {})}
    differences = compare(
        f"{where}.settings", expected_settings, _settings_values(settings, expected_settings)
    )
    differences += [f"{where}.settings: {variable} is not a setting" for variable in unknown]
    # A setting the pod sets that the baseline does not pin would pass unseen (a new
    # STEADY_ENGINE=inprocess puts the probes back on the traffic loop).
    differences += [
        f"{where}.settings.{field}: set by the pod ({variable}), not pinned in the baseline"
        for variable, field in pod_setting_fields(environment.variables)
        if field not in expected_settings
    ]
    differences += [f"{where}.settings: {line}" for line in environment.unreadable]
    k8s_actual = read_k8s(manifests)
    differences += compare(where, {**baseline.k8s, **overlay.get("k8s", {})}, k8s_actual)

    envoy_config_maps = [
        m
        for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["name"].startswith(ENVOY_CONFIG_MAP_PREFIX)
    ]
    # The relations below read the Envoy this overlay deploys: its ConfigMap's, where it has one.
    overlay_envoy_text = envoy_file_text
    if len(envoy_config_maps) != 1:
        differences.append(f"{where}: expected one {ENVOY_CONFIG_MAP_PREFIX} ConfigMap")
    elif (text := envoy_config_maps[0].get("data", {}).get(ENVOY_CONFIG_KEY)) != envoy_file_text:
        differences.append(f"{where}: the Envoy ConfigMap differs from deploy/envoy/envoy.yaml")
        if isinstance(text, str):
            overlay_envoy_text = text

    # Relations between sources, on this overlay's own values (the baseline's may differ).
    try:
        overlay_envoy = read_envoy(yaml.safe_load(overlay_envoy_text))
    except yaml.YAMLError as error:
        problem = " ".join(str(error).split())  # one line, as every config error
        raise ConfigError(f"{where}: its Envoy ConfigMap: {problem}") from error
    differences += check_overlay_invariants(
        OverlayValues(
            where=where,
            settings=settings,
            k8s=k8s_actual,
            envoy=overlay_envoy,
            probe_ports=probe_ports(manifests),
            replica_inflight=baseline.replica_inflight,
            resident_mb=baseline.resident_mb,
        )
    )
    return differences


def run_checks(baseline_path: Path, envoy_path: Path, k8s_path: Path) -> list[str]:
    """Every difference between the baseline and the shipped configuration, one line each.
    Each overlay under `k8s_path`/overlays is checked; a tree with none, by its base as the
    one overlay `BASE_ONLY` (its own values, if any, under `overlays.base`)."""
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
        described = describe_validation_error(error, os.environ)
        raise ConfigError(f"this environment: {described}") from error
    else:
        differences += compare(
            "settings", baseline.settings, _settings_values(process_settings, baseline.settings)
        )
    differences += check_envoy(baseline, envoy_config, "envoy")
    differences += check_envoy_invariants(read_envoy(envoy_config))

    kustomizations = _deployed_overlays(k8s_path)
    found = sorted(kustomizations)
    # A base-only tree needs no `overlays.base` in the baseline: the shared values are its.
    expected = sorted(baseline.overlays) or ([BASE_ONLY] if found == [BASE_ONLY] else [])
    if found != expected:
        differences.append(f"k8s.overlays: baseline {sorted(baseline.overlays)}, actual {found}")
    if found == [BASE_ONLY] and not baseline.overlays:
        baseline.check_base_keys(baseline_path)
    for name in sorted(set(found) & set(expected)):
        kustomization = kustomizations[name]
        try:
            manifests = render_kustomization(kustomization)
            differences += check_overlay(baseline, name, manifests, envoy_text)
        except OSError as error:
            raise ConfigError(f"overlay {name}: {error}") from error
        except ConfigError as error:
            raise ConfigError(f"overlay {name}: {error}") from error
    return differences


def _deployed_overlays(k8s_path: Path) -> dict[str, Path]:
    """Each overlay's kustomization directory by name; a tree without overlays deploys its
    base, checked as the one overlay `BASE_ONLY` (it was not checked at all, its relations
    included)."""
    overlays_dir = k8s_path / "overlays"
    if overlays_dir.is_dir():
        overlays = {p.name: p for p in overlays_dir.iterdir() if p.is_dir()}
        if overlays:
            return overlays
    return {BASE_ONLY: k8s_path / "base"}


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
