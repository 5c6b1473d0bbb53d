"""deploy/baseline.yaml: the production limits, loaded and checked for keys nothing reads."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from app.checkconfig.common import ConfigError
from app.checkconfig.envoy_config import ENVOY_FIELDS
from app.checkconfig.sources import K8S_FIELDS
from app.settings import Settings


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
        # A section left empty (its entries commented out) is YAML null: no entries.
        overlays: dict[str, dict[str, dict[str, Any]]] = {}
        listed = _section(loaded, "overlays", path)
        for name in listed:
            overlay = _section(listed, name, path, "overlays.")
            overlays[name] = {
                part: _section(overlay, part, path, f"overlays.{name}.") for part in overlay
            }
        baseline = cls(
            settings=_section(loaded, "settings", path),
            envoy=_section(loaded, "envoy", path),
            k8s=_section(loaded, "k8s", path),
            overlays=overlays,
            capacity=_section(loaded, "capacity", path),
        )
        baseline._check_keys(path)
        baseline._check_capacity(path)
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
            problems += self._k8s_key_problems(overlay.get("k8s", {}), f"overlays.{name}: ")
        if problems:
            raise ConfigError(f"{path}: " + "; ".join(problems))

    def check_base_keys(self, path: Path) -> None:
        """For a tree checked by its base alone (no overlays): the shared `k8s` values must
        name every field check-config reads, as an overlay's do."""
        problems = self._k8s_key_problems({}, "")
        if problems:
            raise ConfigError(f"{path}: " + "; ".join(problems))

    def _k8s_key_problems(self, overlay_k8s: Mapping[str, Any], where: str) -> list[str]:
        k8s_keys = {**self.k8s, **overlay_k8s}
        problems = [
            f"{where}k8s.{key} is not read by check-config"
            for key in k8s_keys
            if key not in K8S_FIELDS
        ]
        problems += [
            f"{where}k8s.{key} is missing from the baseline"
            for key in K8S_FIELDS
            if key not in k8s_keys
        ]
        return problems

    def _check_capacity(self, path: Path) -> None:
        """The capacity figures are counts the relations compute with: a value that is not
        one is a config error, not a traceback (nor a float silently rounded down)."""
        value = self.capacity["replica_inflight"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(
                f"{path}: capacity.replica_inflight must be a whole number of requests (at "
                f"least 1), not {value!r}"
            )
        for key in ("replica_resident_mb", "frontend_resident_mb"):
            value = self.capacity[key]
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ConfigError(
                    f"{path}: capacity.{key} must be a positive number, not {value!r}"
                )

    @property
    def replica_inflight(self) -> int:
        """capacity.replica_inflight, checked when loaded."""
        value: int = self.capacity["replica_inflight"]
        return value

    @property
    def resident_mb(self) -> tuple[float, float]:
        """capacity.replica_resident_mb and frontend_resident_mb, checked when loaded."""
        return (
            float(self.capacity["replica_resident_mb"]),
            float(self.capacity["frontend_resident_mb"]),
        )


# Baseline keys under `capacity:`.
CAPACITY_FIELDS = ("replica_inflight", "replica_resident_mb", "frontend_resident_mb")


def _section(parent: Mapping[str, Any], key: str, path: Path, where: str = "") -> dict[str, Any]:
    """`parent[key]` as a mapping: {} where it is absent or null; a ConfigError otherwise."""
    value = parent.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: {where}{key} must be a mapping, not {type(value).__name__}")
    return value
