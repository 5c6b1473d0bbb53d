"""`steadyserve check-config` reads each route's values from the route Envoy really picks
for its path, and holds every route to the one retry policy the baseline pins."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.checkconfig_support import check, replace_once

# Order of the shipped routes: /v1/completions, /v1/chat/completions, first; the catch-all
# "/" last (inserting at it puts a route just before it).
COMPLETIONS, CHAT, CATCH_ALL = 0, 1, -1


def edit_virtual_host(deploy: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the ingress listener's virtual host as data (aliases expanded, comments lost)."""
    path = deploy / "envoy" / "envoy.yaml"
    config = yaml.safe_load(path.read_text())
    (listener,) = [
        entry
        for entry in config["static_resources"]["listeners"]
        if entry["name"] == "steadyserve_ingress"
    ]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    edit(hcm["route_config"]["virtual_hosts"][0])
    path.write_text(yaml.safe_dump(config))


def edit_routes(deploy: Path, edit: Callable[[list[dict[str, Any]]], None]) -> None:
    edit_virtual_host(deploy, lambda virtual_host: edit(virtual_host["routes"]))


def test_a_route_after_the_catch_all_is_refused_and_read_as_envoy_picks(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With "/" first, Envoy gives generation the 10 s of the catch-all."""
    edit_routes(deploy_copy, lambda routes: routes.insert(0, routes.pop(CATCH_ALL)))
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "envoy.completions_route_timeout_s: baseline 60.0, actual 10.0" in out
    assert "envoy.chat_route_timeout_s: baseline 60.0, actual 10.0" in out
    assert (
        'envoy.routes: the route matching {"path": "/v1/completions"} comes after the '
        'catch-all {"prefix": "/"} and never matches' in out
    )


def test_a_route_that_retries_differently_is_named(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def retry_chat_more(routes: list[dict[str, Any]]) -> None:
        routes[CHAT]["route"] = copy.deepcopy(routes[CHAT]["route"])
        routes[CHAT]["route"]["retry_policy"]["num_retries"] = 5

    edit_routes(deploy_copy, retry_chat_more)
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert (
        'envoy.routes: the route matching {"path": "/v1/chat/completions"} retries '
        "differently from the /infer route in num_retries" in out
    )
    assert '{"path": "/v1/completions"} retries' not in out


def test_a_route_for_a_path_the_baseline_does_not_pin_must_retry_the_same_way(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A route of its own for /v1/embeddings retrying every 5xx would carry a 503
    engine_lost (a query of death) from replica to replica."""

    def embeddings_route_retrying_5xx(routes: list[dict[str, Any]]) -> None:
        route = copy.deepcopy(routes[CATCH_ALL]["route"])
        route["retry_policy"] = {"retry_on": "5xx", "num_retries": 3}
        routes.insert(CATCH_ALL, {"match": {"path": "/v1/embeddings"}, "route": route})

    edit_routes(deploy_copy, embeddings_route_retrying_5xx)
    assert check(deploy_copy) == 1
    assert (
        'envoy.routes: the route matching {"path": "/v1/embeddings"} retries differently '
        "from the /infer route in" in capsys.readouterr().out
    )


def test_a_route_regex_python_cannot_read_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def unicode_class_regex(routes: list[dict[str, Any]]) -> None:
        routes[COMPLETIONS]["match"] = {"safe_regex": {"regex": "/v1/\\pL+"}}

    edit_routes(deploy_copy, unicode_class_regex)
    assert check(deploy_copy) == 2
    assert "cannot be read here" in capsys.readouterr().err


def test_a_retry_header_is_compared_with_its_format(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Retry-After read as a Unix timestamp: every 429 waits the whole max_interval."""
    replace_once(deploy_copy / "envoy" / "envoy.yaml", "format: SECONDS", "format: UNIX_TIMESTAMP")
    assert check(deploy_copy) == 1
    assert (
        'envoy.rate_limited_retry_reset_headers: baseline [{"name": "retry-after", "format": '
        '"SECONDS"}], actual [{"name": "retry-after", "format": "UNIX_TIMESTAMP"}]'
        in capsys.readouterr().out
    )


def test_a_retriable_header_matcher_is_compared_with_its_match_kind(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Same header name, a prefix match instead of presence: other answers are retried."""
    replace_once(
        deploy_copy / "envoy" / "envoy.yaml",
        "                                  present_match: true\n",
        '                                  string_match: { prefix: "1" }\n',
    )
    assert check(deploy_copy) == 1
    assert (
        'envoy.retriable_headers: baseline [{"name": "x-steadyserve-retry-elsewhere", '
        '"present_match": true}], actual [{"name": "x-steadyserve-retry-elsewhere", '
        '"string_match": {"prefix": "1"}}]' in capsys.readouterr().out
    )


def test_a_route_chosen_by_more_than_its_path_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def match_a_header_too(routes: list[dict[str, Any]]) -> None:
        routes[COMPLETIONS]["match"]["headers"] = [{"name": "x-model", "present_match": True}]

    edit_routes(deploy_copy, match_a_header_too)
    assert check(deploy_copy) == 2
    assert "check-config cannot tell which route Envoy picks" in capsys.readouterr().err


def test_a_regex_too_large_for_python_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def huge_repeat(routes: list[dict[str, Any]]) -> None:
        routes[COMPLETIONS]["match"] = {"safe_regex": {"regex": "a{1,99999999999}"}}

    edit_routes(deploy_copy, huge_repeat)
    assert check(deploy_copy) == 2
    assert "cannot be read here" in capsys.readouterr().err


def test_an_empty_retry_policy_on_a_route_is_its_own_not_the_default(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Envoy applies a route's own retry_policy, even `{}` (no retries), over the virtual
    host's: a draining replica's 503 would reach the client."""

    def policy_on_the_host_chat_opting_out(virtual_host: dict[str, Any]) -> None:
        routes = virtual_host["routes"]
        virtual_host["retry_policy"] = copy.deepcopy(routes[CATCH_ALL]["route"]["retry_policy"])
        for entry in routes:
            if "route" in entry:  # not the direct responses (/metrics, /debug)
                entry["route"] = copy.deepcopy(entry["route"])
                del entry["route"]["retry_policy"]
        routes[CHAT]["route"]["retry_policy"] = {}

    edit_virtual_host(deploy_copy, policy_on_the_host_chat_opting_out)
    assert check(deploy_copy) == 1
    assert '{"path": "/v1/chat/completions"} retries differently' in capsys.readouterr().out


def test_a_retry_policy_that_is_no_mapping_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def listed_policy(routes: list[dict[str, Any]]) -> None:
        routes[CHAT]["route"] = copy.deepcopy(routes[CHAT]["route"])
        routes[CHAT]["route"]["retry_policy"] = ["5xx"]

    edit_routes(deploy_copy, listed_policy)
    assert check(deploy_copy) == 2
    assert "a retry_policy must be a mapping" in capsys.readouterr().err
