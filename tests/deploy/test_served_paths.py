"""Every path a shipped file requests is one the server listening on that port serves.

What is served is read from the servers themselves, never from a copied list:
- steadyserve's traffic port (the container's `serve --port`, parsed by the real CLI): GET
  routes of the FastAPI app `create_app` builds (an engine double: no model is loaded),
  matched by Starlette's own route matching;
- its probe port (STEADY_HEALTH_PORT from the pod's rendered ConfigMap and env, parsed as the
  server parses it): `app.probes.PROBE_PORT_PATHS`, the paths its `ProbeListener` routes
  (the verdicts and /metrics; tests/unit/test_probe_metrics.py holds the listener to it);
- an Envoy port: the exact-path routes of the listener on that port in the envoy.yaml the
  Envoy pod mounts (the stats listener proxies two admin paths; admin stays on 127.0.0.1).

Checked, in both rendered overlays: the Dockerfile HEALTHCHECK's URL (on STEADY_HEALTH_PORT);
every httpGet probe of every container (a named port resolved to its containerPort); every
ServiceMonitor endpoint (Service port -> targetPort -> the selected pods' container port);
each Envoy cluster's HTTP health check (its endpoint's address names the Service it reaches,
its `health_check_config` the port, else the endpoint's own). Also the paths
deploy/baseline.yaml pins, which check-config compares with the manifests: the Kubernetes
probe paths and Envoy's health check path (on the probe port, as check-config's invariants
require).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml
from fastapi import FastAPI
from starlette.routing import Match

from app.checkconfig import render_kustomization
from app.checkconfig.common import ENVOY_CONFIG_KEY, HCM_FILTER, SERVER_CONTAINER, Manifest, dig
from app.checkconfig.pod_settings import pod_environment, settings_from_environment
from app.cli import build_parser
from app.main import create_app
from app.probes import PROBE_PORT_PATHS
from app.settings import Settings
from loadtest.null_engine import AlwaysReadyEngine
from tests.deploy.test_dockerfile import DOCKERFILE, instructions
from tests.deploy.tools import DEPLOY

OVERLAYS = ("cpu", "gpu")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
# The URL the HEALTHCHECK's Python one-liner opens: the probe port, then a literal path.
_HEALTHCHECK_URL = re.compile(r"""STEADY_HEALTH_PORT'\]\s*\+\s*'([^'?]*)""")


@functools.cache
def _traffic_app() -> FastAPI:
    settings = Settings()
    return create_app(settings, engine=AlwaysReadyEngine(settings))


def traffic_serves(path: str) -> bool:
    """Whether the app steadyserve serves on its traffic port routes GET `path` (Starlette's
    own matching: a route that takes the path and the method)."""
    scope = {"type": "http", "method": "GET", "path": path, "root_path": "", "headers": []}
    return any(route.matches(scope)[0] is Match.FULL for route in _traffic_app().router.routes)


def probe_port_serves(path: str) -> bool:
    """Whether the probe port answers `path`: the paths `ProbeListener` routes."""
    return path in PROBE_PORT_PATHS


class Server(NamedTuple):
    """Who listens on a container port (None: nobody), and whether it serves a GET path."""

    port: int | None
    name: str
    serves: Callable[[str], bool]


NOBODY = Server(None, "nothing", lambda path: False)


def _of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [m for m in manifests if m["kind"] == kind]


def _pod_spec(deployment: Manifest) -> Manifest:
    spec = dig(deployment, "spec.template.spec")
    assert isinstance(spec, dict)
    return spec


def _mounted_envoy_config(manifests: list[Manifest], pod_spec: Manifest) -> Any:
    """The Envoy config (envoy.yaml) of a ConfigMap the pod mounts; None if it mounts none."""
    mounted = {v["configMap"]["name"] for v in pod_spec.get("volumes") or [] if "configMap" in v}
    for config_map in _of_kind(manifests, "ConfigMap"):
        data = config_map.get("data") or {}
        if config_map["metadata"]["name"] in mounted and ENVOY_CONFIG_KEY in data:
            return yaml.safe_load(data[ENVOY_CONFIG_KEY])
    return None


def _envoy_listener_paths(config: Any, port: int) -> set[str]:
    """The exact paths the listener on `port` routes."""
    paths: set[str] = set()
    for listener in config["static_resources"]["listeners"]:
        if dig(listener, "address.socket_address.port_value") != port:
            continue
        for chain in listener["filter_chains"]:
            for http in (f["typed_config"] for f in chain["filters"] if f["name"] == HCM_FILTER):
                for host in http["route_config"]["virtual_hosts"]:
                    paths |= {r["match"]["path"] for r in host["routes"] if "path" in r["match"]}
    return paths


def server_at(
    manifests: list[Manifest], deployment: Manifest, container: Manifest, port: int | str
) -> Server:
    """The server listening on `port` (a number, or the name of one the container declares)
    of the container."""
    declared = {p.get("name"): p["containerPort"] for p in container.get("ports") or []}
    number = declared.get(port) if isinstance(port, str) else port
    if number is None:
        return NOBODY
    if container["name"] == SERVER_CONTAINER:
        environment = pod_environment(manifests)
        settings, _ = settings_from_environment(environment.variables)
        arguments = build_parser().parse_args(container.get("args") or [])
        if number == settings.health_port:
            return Server(number, "the probe port", probe_port_serves)
        if number == (arguments.port if arguments.port is not None else settings.port):
            return Server(number, "the traffic port", traffic_serves)
        return Server(number, "nothing", NOBODY.serves)
    envoy_config = _mounted_envoy_config(manifests, _pod_spec(deployment))
    if envoy_config is None:
        return Server(number, f"unknown: container {container['name']}", NOBODY.serves)
    paths = frozenset(_envoy_listener_paths(envoy_config, number))
    return Server(number, f"Envoy's listener, routing {sorted(paths)}", paths.__contains__)


def _service_targets(
    manifests: list[Manifest], service: Manifest, port: int | str
) -> Iterator[tuple[Manifest, Manifest, int | str]]:
    """(Deployment, container, container port) behind `port` (name or number) of `service`."""
    ports = service["spec"]["ports"]
    entry = next((p for p in ports if port in (p.get("name"), p["port"])), None)
    assert entry is not None, f"Service {service['metadata']['name']} has no port {port}"
    target = entry.get("targetPort", entry["port"])
    selector = service["spec"]["selector"].items()
    for deployment in _of_kind(manifests, "Deployment"):
        if selector <= dig(deployment, "spec.template.metadata.labels").items():
            for container in _pod_spec(deployment)["containers"]:
                yield deployment, container, target


def _check(problems: list[str], where: str, path: Any, port: Any, server: Server) -> None:
    if not (isinstance(path, str) and server.serves(path)):
        problems.append(
            f"{where}: {path} on port {port} ({server.port}: {server.name}) is not served there"
        )


def _check_service(
    problems: list[str],
    where: str,
    manifests: list[Manifest],
    service: Manifest,
    port: int | str,
    path: Any,
) -> None:
    """`path` requested from `port` of `service`: served by each pod container behind it
    that declares the port it targets (and there must be one)."""
    reached = 0
    for deployment, container, target in _service_targets(manifests, service, port):
        server = server_at(manifests, deployment, container, target)
        if server.port is not None:
            reached += 1
            _check(problems, where, path, port, server)
    if not reached:
        problems.append(
            f"{where}: port {port} of Service {service['metadata']['name']} reaches no container"
        )


def path_problems(deploy: Path, dockerfile: Path) -> list[str]:
    """Every requested path that the server on its port does not serve, named."""
    problems = _healthcheck_problems(dockerfile) + _baseline_problems(deploy)
    for overlay in OVERLAYS:
        manifests = render_kustomization(deploy / "k8s" / "overlays" / overlay)
        problems += _probe_problems(overlay, manifests)
        problems += _monitor_problems(overlay, manifests)
        problems += _envoy_health_check_problems(overlay, manifests)
    return problems


def _healthcheck_problems(dockerfile: Path) -> list[str]:
    problems = []
    for key, args in instructions(dockerfile.read_text()):
        if key != "HEALTHCHECK":
            continue
        url = _HEALTHCHECK_URL.search(args)
        if url is None:
            problems.append("Dockerfile HEALTHCHECK requests no path on STEADY_HEALTH_PORT")
        elif not probe_port_serves(url.group(1)):
            problems.append(f"Dockerfile HEALTHCHECK: {url.group(1)} is not a probe port path")
    return problems


def _baseline_problems(deploy: Path) -> list[str]:
    problems = []
    baseline = yaml.safe_load((deploy / "baseline.yaml").read_text())
    pinned = [("k8s", baseline["k8s"])] + [
        (f"overlays.{name}.k8s", overlay.get("k8s") or {})
        for name, overlay in baseline["overlays"].items()
    ]
    for where, section in pinned:
        for probe in ("startup", "readiness", "liveness"):
            path = section.get(f"{probe}_probe_path")
            if path is not None and not probe_port_serves(path):
                problems.append(f"baseline {where}.{probe}_probe_path: {path} is not a probe path")
    health_check_path = baseline["envoy"]["health_check_path"]
    if not probe_port_serves(health_check_path):
        problems.append(f"baseline envoy.health_check_path: {health_check_path} is not served")
    return problems


def _probe_problems(overlay: str, manifests: list[Manifest]) -> list[str]:
    problems: list[str] = []
    for deployment in _of_kind(manifests, "Deployment"):
        for container in _pod_spec(deployment)["containers"]:
            for probe in PROBES:
                get = dig(container, f"{probe}.httpGet")
                if get is not None:
                    name = f"{deployment['metadata']['name']}/{container['name']}"
                    server = server_at(manifests, deployment, container, get["port"])
                    where = f"{overlay}: {name} {probe}"
                    _check(problems, where, get.get("path"), get["port"], server)
    return problems


def _monitor_problems(overlay: str, manifests: list[Manifest]) -> list[str]:
    problems: list[str] = []
    services = _of_kind(manifests, "Service")
    for monitor in _of_kind(manifests, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services if selector <= s["metadata"]["labels"].items()]
        where = f"{overlay}: ServiceMonitor {monitor['metadata']['name']}"
        for endpoint in monitor["spec"]["endpoints"]:
            port, path = endpoint["port"], endpoint.get("path")
            _check_service(problems, where, manifests, service, port, path)
    return problems


def _envoy_health_check_problems(overlay: str, manifests: list[Manifest]) -> list[str]:
    """Each cluster endpoint's address is a Service's name (DNS): the check reaches its pods."""
    problems: list[str] = []
    services = {s["metadata"]["name"]: s for s in _of_kind(manifests, "Service")}
    (config,) = [
        yaml.safe_load(m["data"][ENVOY_CONFIG_KEY])
        for m in _of_kind(manifests, "ConfigMap")
        if ENVOY_CONFIG_KEY in (m.get("data") or {})
    ]
    for cluster in config["static_resources"]["clusters"]:
        where = f"{overlay}: Envoy cluster {cluster['name']} health check"
        for check in cluster.get("health_checks") or []:
            path = dig(check, "http_health_check.path")
            for group in cluster["load_assignment"]["endpoints"]:
                for endpoint in group["lb_endpoints"]:
                    address = endpoint["endpoint"]["address"]["socket_address"]
                    service = services.get(address["address"])
                    checked = dig(endpoint, "endpoint.health_check_config.port_value")
                    if service is None:
                        problems.append(f"{where}: {address['address']} is no Service")
                    else:
                        port = address["port_value"] if checked is None else checked
                        _check_service(problems, where, manifests, service, port, path)
    return problems


def test_shipped_files_request_only_served_paths() -> None:
    assert path_problems(DEPLOY, DOCKERFILE) == []
    # Not vacuous: the servers serve the paths the files name, and only those.
    assert all(map(probe_port_serves, ["/healthz", "/readyz", "/metrics"]))
    assert all(map(traffic_serves, ["/healthz", "/readyz", "/metrics", "/v2/models/m/ready"]))
    assert not any(map(probe_port_serves, ["/metric", "/healthz/", "/", "/v2/health/ready"]))
    assert not any(map(traffic_serves, ["/health", "/metric", "/infer"]))  # /infer: POST


@pytest.mark.parametrize(
    ("file", "old", "new", "named"),
    [
        (
            "k8s/base/steadyserve-deployment.yaml",
            "path: /healthz",
            "path: /health",
            "steadyserve livenessProbe: /health on port probes (8001: the probe port)",
        ),
        (
            "k8s/base/steadyserve-deployment.yaml",
            "path: /readyz\n              port: probes\n            periodSeconds: 5\n"
            "            timeoutSeconds: 2\n            failureThreshold: 1",
            "path: /v2/health/ready\n              port: probes\n            periodSeconds: 5\n"
            "            timeoutSeconds: 2\n            failureThreshold: 1",
            # Served on the traffic port, not on the probe port the probe goes to.
            "steadyserve readinessProbe: /v2/health/ready on port probes (8001: the probe port)",
        ),
        (
            "k8s/base/envoy-deployment.yaml",
            "path: /ready",
            "path: /readiness",
            "envoy/envoy readinessProbe: /readiness on port stats (9902: Envoy's listener",
        ),
        (
            "k8s/base/servicemonitor.yaml",
            "path: /metrics",
            "path: /metric",
            "cpu: ServiceMonitor steadyserve: /metric on port probes (8001: the probe port)",
        ),
        (
            "k8s/base/servicemonitor.yaml",
            "path: /stats/prometheus",
            "path: /stats",
            "ServiceMonitor steadyserve-envoy: /stats on port stats (9902: Envoy's listener",
        ),
        (
            "envoy/envoy.yaml",
            "path: /readyz",
            "path: /ready",
            "Envoy cluster steadyserve health check: /ready on port 8001 (8001: the probe port)",
        ),
        (
            "baseline.yaml",
            "liveness_probe_path: /healthz",
            "liveness_probe_path: /health",
            "baseline k8s.liveness_probe_path: /health",
        ),
        (
            "baseline.yaml",
            "health_check_path: /readyz",
            "health_check_path: /ready",
            "baseline envoy.health_check_path: /ready",
        ),
    ],
    ids=[
        "liveness-probe",
        "readiness-probe-on-the-wrong-port",
        "envoy-readiness-probe",
        "servicemonitor",
        "envoy-servicemonitor",
        "envoy-health-check",
        "baseline-probe",
        "baseline-health-check",
    ],
)
def test_a_renamed_path_is_named(
    deploy_copy: Path, file: str, old: str, new: str, named: str
) -> None:
    """The check above can fail: one path renamed in one file."""
    path = deploy_copy / file
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    problems = path_problems(deploy_copy, DOCKERFILE)
    assert any(named in problem for problem in problems), problems


def test_a_renamed_healthcheck_path_is_named(tmp_path: Path) -> None:
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text(DOCKERFILE.read_text().replace("'/healthz'", "'/health'"))
    assert path_problems(DEPLOY, dockerfile) == [
        "Dockerfile HEALTHCHECK: /health is not a probe port path"
    ]
