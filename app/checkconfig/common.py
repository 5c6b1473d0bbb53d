"""Names and the error shared by the drift check's modules."""

from __future__ import annotations

from typing import Any

from app.settings import Settings

Manifest = dict[str, Any]

# The prefix pydantic-settings reads settings variables with: the server's own.
ENV_PREFIX: str = Settings.model_config.get("env_prefix") or ""
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


def dig(node: Any, path: str) -> Any:
    """`a.b.0.c` into nested dicts and lists; None where any step is missing."""
    for step in path.split("."):
        if isinstance(node, dict):
            node = node.get(step)
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


def named(items: Any, name: str, what: str) -> Any:
    """The item of a list of mappings whose `name` is `name`."""
    for item in items or []:
        if isinstance(item, dict) and item.get("name") == name:
            return item
    raise ConfigError(f"no {what} named {name!r}")
