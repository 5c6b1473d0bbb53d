"""The route Envoy picks for a request path, as its router picks it: the first entry of the
virtual host whose match matches the path (so their order matters), with the retry policy it
then applies (the route's own, else the virtual host's: they are never merged)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from app.checkconfig.common import ConfigError, dig

# The paths whose routes the baseline pins: the two generation routes, and /infer for the
# catch-all that every other path (embeddings, tensors, ...) shares.
ROUTED_PATHS: Mapping[str, str] = {
    "route": "/infer",
    "completions_route": "/v1/completions",
    "chat_route": "/v1/chat/completions",
}
_PATH_MATCHERS = frozenset({"prefix", "path", "path_separated_prefix", "safe_regex"})


@dataclass(frozen=True)
class PickedRoute:
    match: Any  # the entry's match, for messages
    route: Any  # its `route` action; None for a redirect or a direct response
    retry_policy: Any  # the route's own retry policy, else the virtual host's; None if neither


def pick_routes(virtual_host: Any) -> dict[str, PickedRoute | None]:
    """The entry Envoy picks for each of `ROUTED_PATHS`; None where no entry matches (404)."""
    entries = _route_entries(virtual_host)
    picked: dict[str, PickedRoute | None] = {}
    for name, path in ROUTED_PATHS.items():
        entry = next((e for e in entries if _matches(e["match"], path)), None)
        picked[name] = None
        if entry is not None:
            route = entry.get("route")
            picked[name] = PickedRoute(entry["match"], route, _retry_policy(route, virtual_host))
    return picked


def route_problems(virtual_host: Any) -> list[str]:
    """Entries no request can reach (after a catch-all), and entries that would retry
    differently from the catch-all: the baseline pins one retry policy for every route."""
    problems: list[str] = []
    catch_all = None
    for entry in _route_entries(virtual_host):
        if catch_all is not None:
            problems.append(
                f"envoy.routes: the route matching {_show(entry['match'])} comes after the "
                f"catch-all {_show(catch_all)} and never matches (Envoy picks the first route "
                "that matches a request)"
            )
        elif _is_catch_all(entry["match"]):
            catch_all = entry["match"]
    reference = pick_routes(virtual_host)["route"]
    reference_policy = (reference.retry_policy if reference else None) or {}
    # Every entry that forwards, not only the pinned paths': one that retried `5xx` on any
    # path would carry a query of death (a 503 engine_lost) from replica to replica.
    for entry in _route_entries(virtual_host):
        route = entry.get("route")
        if route is None:
            continue  # a redirect or a direct response: nothing is forwarded or retried
        policy = _retry_policy(route, virtual_host) or {}
        differing = sorted(
            key
            for key in set(policy) | set(reference_policy)
            if policy.get(key) != reference_policy.get(key)
        )
        if differing:
            problems.append(
                f"envoy.routes: the route matching {_show(entry['match'])} retries differently "
                f"from the {ROUTED_PATHS['route']} route in {', '.join(differing)}: every "
                "route must retry as the baseline says"
            )
    return problems


def _retry_policy(route: Any, virtual_host: Any) -> Any:
    """The route's own retry policy where it has one (even an empty one: Envoy then retries
    nothing), else the virtual host's; None if neither. ConfigError if it is no mapping."""
    own = dig(route, "retry_policy")
    policy = own if own is not None else dig(virtual_host, "retry_policy")
    if policy is not None and not isinstance(policy, dict):
        raise ConfigError(f"envoy.yaml: a retry_policy must be a mapping, not {policy!r}")
    return policy


def _route_entries(virtual_host: Any) -> list[dict[str, Any]]:
    entries = dig(virtual_host, "routes") or []
    if not isinstance(entries, list) or not all(
        isinstance(entry, dict) and isinstance(entry.get("match"), dict) for entry in entries
    ):
        raise ConfigError("envoy.yaml: every entry of the virtual host's routes needs a match")
    return entries


def _is_catch_all(match: Mapping[str, Any]) -> bool:
    return set(match) - {"case_sensitive"} == {"prefix"} and match["prefix"] in ("", "/")


def _matches(match: Mapping[str, Any], path: str) -> bool:
    """Whether Envoy's route match `match` takes a request for `path` (no query string)."""
    not_understood = set(match) - _PATH_MATCHERS - {"case_sensitive"}
    matchers = set(match) & _PATH_MATCHERS
    if not_understood or len(matchers) != 1:
        # Headers, query parameters, runtime fractions...: which requests the route takes
        # depends on more than the path, so which route Envoy picks cannot be read here.
        raise ConfigError(
            f"envoy.yaml: route match {_show(match)} is not a single path matcher "
            f"({', '.join(sorted(_PATH_MATCHERS))}); check-config cannot tell which route "
            "Envoy picks"
        )
    (kind,) = matchers
    value = match[kind]
    if kind == "safe_regex":
        try:
            return re.fullmatch(str(dig(value, "regex")), path) is not None
        # RE2 syntax Python does not share, not a regex, or one too large for Python's.
        except (re.error, OverflowError, RecursionError) as error:
            raise ConfigError(
                f"envoy.yaml: route regex {_show(value)} cannot be read here ({error}); "
                "check-config cannot tell which route Envoy picks"
            ) from None
    case_sensitive = match.get("case_sensitive", True) is not False
    wanted, seen = (str(value), path) if case_sensitive else (str(value).lower(), path.lower())
    if kind == "path":
        return seen == wanted
    if kind == "prefix":
        return seen.startswith(wanted)
    return seen == wanted or seen.startswith(wanted.rstrip("/") + "/")  # path_separated_prefix


def _show(value: Any) -> str:
    return json.dumps(value, sort_keys=True)
