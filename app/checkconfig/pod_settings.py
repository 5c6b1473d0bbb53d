"""The settings a pod really gets: its environment as Kubernetes builds it from the rendered
manifests, parsed as the server parses it (pydantic-settings' own environment source)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsError,
)

from app.checkconfig.common import ENV_PREFIX, SERVER_CONTAINER, ConfigError, Manifest, dig
from app.checkconfig.kustomize import find_manifest
from app.checkconfig.quantities import cpu_count
from app.checkconfig.sources import server_parts
from app.cli import CommandLineError, serve_command_overrides
from app.settings import Settings

# pydantic-settings matches variable names to fields ignoring case unless told otherwise;
# whatever it would read, the checker must read too.
_CASE_SENSITIVE = bool(Settings.model_config.get("case_sensitive", False))


def _folded(text: str) -> str:
    """`text` as pydantic-settings compares variable names."""
    return text if _CASE_SENSITIVE else text.upper()


def is_setting_name(name: str) -> bool:
    """Whether pydantic-settings would look at `name` for some setting (prefix matched as it
    matches it); not whether the rest names a field."""
    return _folded(name).startswith(_folded(ENV_PREFIX))


def _field_of(name: str) -> str | None:
    """The setting a variable would set if the rest of its name is a field; None where it
    does not carry the prefix."""
    return name[len(ENV_PREFIX) :].lower() if is_setting_name(name) else None


@dataclass
class PodEnvironment:
    # The settings variables the server container starts with, as Kubernetes sets them.
    variables: dict[str, str] = field(default_factory=dict)
    # One line per settings variable whose value comes from somewhere the checker cannot read.
    unreadable: list[str] = field(default_factory=list)
    # The settings the container's command line overrides (`serve --host --port`), which win
    # over the environment, and that command line as written.
    overrides: dict[str, Any] = field(default_factory=dict)
    command_line: str = ""


def pod_environment(manifests: list[Manifest]) -> PodEnvironment:
    """The server container's settings variables: its envFrom ConfigMaps (with their
    `prefix`), then its own env (later wins, as in Kubernetes), with configMapKeyRef resolved
    from the rendered ConfigMaps and resourceFieldRef on limits.cpu as the kubelet does."""
    _, container = server_parts(manifests)
    environment = PodEnvironment()
    for source in _container_list(container, "envFrom"):
        reference = source.get("configMapRef")
        if reference is None:
            # A Secret's keys cannot be read here: say so, as for a valueFrom below, unless
            # its prefix rules out every setting name.
            if _prefix_allows_settings(str(source.get("prefix") or "")):
                environment.unreadable.append(
                    f"envFrom {_show_source(source)} is not checked (only ConfigMaps are read)"
                )
            continue
        config_map = _config_map(manifests, reference, "envFrom")
        if config_map is None:
            continue
        prefix = str(source.get("prefix") or "")
        for key, value in (config_map.get("data") or {}).items():
            _set(environment, f"{prefix}{key}", str(value))
    for variable in _container_list(container, "env"):
        name = variable.get("name")
        if not isinstance(name, str):
            raise ConfigError(f"container {SERVER_CONTAINER}: an env entry has no name")
        if is_setting_name(name):
            _set_from_env_entry(environment, manifests, container, variable, name)
    _read_command_line(environment, container)
    return environment


# What the image runs: its ENTRYPOINT, with the container's `args` (else the image's CMD).
IMAGE_ENTRYPOINT = "steadyserve"


def _read_command_line(environment: PodEnvironment, container: Manifest) -> None:
    """The settings the container's command line overrides, as `steadyserve serve` applies
    them (the server's own parser: `cli.serve_command_overrides`)."""
    command, args = container.get("command"), container.get("args")
    for key, value in (("command", command), ("args", args)):
        if value is not None and not (
            isinstance(value, list) and all(isinstance(item, str) for item in value)
        ):
            raise ConfigError(f"container {SERVER_CONTAINER}: {key} is not a list of strings")
    command, args = command or None, args or None  # empty is unset, to Kubernetes
    if command is None and args is None:
        environment.unreadable.append(
            "the server container sets no args: the image's CMD, which check-config cannot "
            "read, may override settings"
        )
        return
    if command is not None and command[0].rsplit("/", 1)[-1] != IMAGE_ENTRYPOINT:
        environment.unreadable.append(
            f"the server container runs {command}, not {IMAGE_ENTRYPOINT}: its command line "
            "is not checked"
        )
        return
    argv = [*(command or [IMAGE_ENTRYPOINT])[1:], *(args or [])]
    environment.command_line = " ".join([IMAGE_ENTRYPOINT, *argv])
    try:
        environment.overrides = serve_command_overrides(argv)
    except CommandLineError as error:
        raise ConfigError(
            f"container {SERVER_CONTAINER}: `{environment.command_line}` would not serve: "
            f"{' '.join(str(error).split())}"
        ) from error


def _set(environment: PodEnvironment, name: str, value: str) -> None:
    if is_setting_name(name):
        environment.variables[name] = value


def _set_from_env_entry(
    environment: PodEnvironment,
    manifests: list[Manifest],
    container: Manifest,
    variable: Manifest,
    name: str,
) -> None:
    if "valueFrom" not in variable:
        environment.variables[name] = str(variable.get("value", ""))
        return
    value_from = variable.get("valueFrom") or {}
    if "configMapKeyRef" in value_from:
        reference = value_from["configMapKeyRef"] or {}
        config_map = _config_map(manifests, reference, f"env {name}")
        if config_map is None:
            return
        data = config_map.get("data") or {}
        key = reference.get("key")
        if key in data:
            environment.variables[name] = str(data[key])
        elif not reference.get("optional"):
            raise ConfigError(
                f"env {name} names key {key!r} of ConfigMap {reference.get('name')!r}, "
                "which it lacks: the pod would not start"
            )
    elif dig(value_from, "resourceFieldRef.resource") == "limits.cpu":
        if str(dig(value_from, "resourceFieldRef.divisor") or "1") != "1":
            raise ConfigError(f"{name}: only divisor 1 is understood")
        cpu_limit = dig(container, "resources.limits.cpu")
        environment.variables[name] = str(cpu_count(cpu_limit))
    else:
        sources = ", ".join(sorted(value_from)) or "nothing"
        environment.unreadable.append(
            f"{name} is set from {sources}, which check-config cannot read: its value is "
            "not checked"
        )


def _config_map(manifests: list[Manifest], reference: Any, where: str) -> Manifest | None:
    """The rendered ConfigMap a reference names; None if absent and `optional`."""
    name = dig(reference, "name")
    config_map = find_manifest(manifests, "ConfigMap", name)
    if config_map is None and not dig(reference, "optional"):
        raise ConfigError(f"{where} names ConfigMap {name!r}, which is absent")
    return config_map


def _container_list(container: Manifest, key: str) -> list[Manifest]:
    """`env` or `envFrom` of a container: null (`env:` with nothing under it) is empty, as to
    Kubernetes; an entry that is not a mapping is refused."""
    items = container.get(key) or []
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise ConfigError(f"container {SERVER_CONTAINER}: {key} is not a list of mappings")
    return items


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


def describe_settings_error(error: SettingsError) -> str:
    """pydantic-settings' "error parsing value for field ..." as the variable that caused it."""
    field_name = re.search(r'field "(\w+)"', str(error))
    if field_name is None:
        return f"{error}: {error.__cause__}"
    return (
        f"{ENV_PREFIX}{field_name.group(1).upper()} is not the JSON its setting's type needs "
        f"({error.__cause__})"
    )


def describe_validation_error(
    error: ValidationError, variables: Mapping[str, str], pod: PodEnvironment | None = None
) -> str:
    """Settings that parse but fail validation (a value out of range, a rule between settings)
    as one line naming each variable (or the pod's command-line flag, which wins over it),
    its value and the rule: a config error, as the server would refuse to start on it, not a
    difference from the baseline."""
    problems = []
    command_line = pod.command_line if pod is not None else ""
    flags = pod.overrides if pod is not None else {}
    with_flags = f" (with the flags of `{command_line}`, which win)" if flags else ""
    for problem in error.errors(include_url=False):
        reason = " ".join(str(problem["msg"]).removeprefix("Value error, ").split())
        location = problem["loc"]
        if not location:
            problems.append(f"the settings together do not validate: {reason}{with_flags}")
            continue
        setting = str(location[0])
        if setting in flags:
            problems.append(f"--{setting} of `{command_line}` does not validate: {reason}")
            continue
        variable = next(
            (name for name in sorted(variables) if _field_of(name) == setting),
            f"{ENV_PREFIX}{setting.upper()}",
        )
        if variable in variables:  # as JSON: a ConfigMap value may span lines, the error not
            variable = f"{variable}={json.dumps(variables[variable])}"
        inside = "".join(f"[{step}]" for step in location[1:])
        where = f" (at {inside})" if inside else ""
        problems.append(f"{variable} does not validate{where}: {reason}")
    return "; ".join(problems)


def settings_from_environment(
    environment: Mapping[str, str], overrides: Mapping[str, Any] | None = None
) -> tuple[Settings, list[str]]:
    """Settings from a pod's environment, parsed by pydantic-settings' own environment source
    (the server's parser: JSON only for fields whose type needs it, names matched as it
    matches them), with `overrides` (the command line's) winning as they win in `serve`;
    also the variables that carry the prefix but name no setting (typos).

    Raises ConfigError where a value cannot be parsed at all (pydantic's SettingsError), and
    pydantic's ValidationError where values parse but fail validation (for
    `describe_validation_error`, which needs the variables to name them)."""
    source = EnvSettingsSource(Settings)
    # The source's own variables, replaced by the pod's, keyed as the source keys them
    # (pydantic-settings' `parse_env_vars`, private, so written out here; it would also map
    # `env_parse_none_str`, which Settings does not set: a test in test_checkconfig_pod_env
    # holds that).
    source.env_vars = {
        (name if source.case_sensitive else name.lower()): value
        for name, value in environment.items()
        if not (source.env_ignore_empty and value == "")
    }
    try:
        values = source()
    except SettingsError as error:
        raise ConfigError(describe_settings_error(error)) from error
    unknown = [
        name
        for name in environment
        if (field := _field_of(name)) is not None and field not in Settings.model_fields
    ]
    return _EnvironmentFreeSettings(**{**values, **(overrides or {})}), unknown


def _show_source(source: Mapping[str, Any]) -> str:
    kinds = sorted(key for key in source if key.endswith("Ref"))
    names = [str(dig(source, f"{kind}.name")) for kind in kinds]
    return ", ".join(f"{kind} {name}" for kind, name in zip(kinds, names, strict=True)) or "?"


def _prefix_allows_settings(prefix: str) -> bool:
    """Whether names `prefix` + key can be settings' (the prefix starts one, or is one)."""
    return is_setting_name(prefix) or _folded(ENV_PREFIX).startswith(_folded(prefix))


def pod_setting_fields(variables: Mapping[str, str]) -> list[tuple[str, str]]:
    """(variable, Settings field) for each of the pod's variables that sets a setting."""
    return [
        (name, field)
        for name in sorted(variables)
        if (field := _field_of(name)) is not None and field in Settings.model_fields
    ]
