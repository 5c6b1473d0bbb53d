"""Who may reach a replica's ports (its NetworkPolicy), and where Prometheus scrapes it (its
ServiceMonitor), in both rendered overlays.

A NetworkPolicy admits a peer to a port, never to a path: the monitoring namespace, let onto
the traffic port to scrape /metrics, reached /infer, /v1, /v2 and /debug there past every
limit Envoy sets (circuit breakers, header timeout and size cap). So the traffic port admits
Envoy's pods alone, and the monitoring namespace is admitted to the probe port
(STEADY_HEALTH_PORT) only, where the supervisor serves /metrics beside the probes and
nothing that reaches the engine; the ServiceMonitor scrapes that port. Envoy's pods reach the
port their health check asks (the endpoint's `health_check_config` in the Envoy ConfigMap the
overlay renders), which must be the probe port. (The kubelet's probes
need no rule: traffic from a pod's own node is always allowed.) Ports are resolved as
Kubernetes resolves them: a name to the server container's port of that name, the traffic
port from the container's `serve --port`, the probe port from the pod's environment, both
parsed as the server parses them.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
import yaml

from app.checkconfig import render_kustomization
from app.checkconfig.common import ENVOY_CONFIG_KEY, SERVER_CONTAINER, Manifest, dig
from app.checkconfig.envoy_config import read_envoy
from app.checkconfig.pod_settings import pod_environment, settings_from_environment
from app.cli import build_parser
from tests.deploy.tools import DEPLOY

OVERLAYS = ("cpu", "gpu")
MONITORING = {"kubernetes.io/metadata.name": "monitoring"}
EVERY_PORT = "every port"
ANYONE = "anyone"


class Replica(NamedTuple):
    labels: dict[str, str]  # of its pods
    ports: dict[str, int]  # the server container's, by name
    traffic: int
    probes: int | None  # STEADY_HEALTH_PORT


def _named(manifests: list[Manifest], kind: str, name: str) -> Manifest:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found


def replica(manifests: list[Manifest]) -> Replica:
    template = dig(_named(manifests, "Deployment", "steadyserve"), "spec.template")
    (container,) = [c for c in template["spec"]["containers"] if c["name"] == SERVER_CONTAINER]
    settings, _ = settings_from_environment(pod_environment(manifests).variables)
    arguments = build_parser().parse_args(container.get("args") or [])
    return Replica(
        labels=template["metadata"]["labels"],
        ports={p["name"]: p["containerPort"] for p in container.get("ports") or []},
        traffic=arguments.port if arguments.port is not None else settings.port,
        probes=settings.health_port,
    )


def _peer(peer: Manifest, envoy_labels: dict[str, str]) -> str:
    """A `from` entry, named: Envoy's pods, the monitoring namespace, or what it is."""
    pods = dig(peer, "podSelector.matchLabels")
    namespaces = dig(peer, "namespaceSelector.matchLabels")
    if "ipBlock" in peer:
        return f"ipBlock {peer['ipBlock'].get('cidr')}"
    if (
        "namespaceSelector" not in peer
        and pods is not None
        and pods.items() <= envoy_labels.items()
    ):
        return "envoy"
    if "podSelector" not in peer and namespaces == MONITORING:
        return "monitoring"
    return f"peer {peer}"


def _port(entry: Manifest, server: Replica) -> int | str:
    port = entry.get("port")
    if port is None:
        return EVERY_PORT
    if "endPort" in entry:
        return f"ports {port}-{entry['endPort']}"
    return server.ports.get(port, f"unknown port {port}") if isinstance(port, str) else port


def admitted(manifests: list[Manifest]) -> set[tuple[str, int | str]]:
    """(peer, container port) pairs every NetworkPolicy that selects the replicas lets in."""
    server = replica(manifests)
    envoy_labels = dig(_named(manifests, "Deployment", "steadyserve-envoy"), "spec.template")
    envoy_labels = envoy_labels["metadata"]["labels"]
    pairs: set[tuple[str, int | str]] = set()
    for policy in (m for m in manifests if m["kind"] == "NetworkPolicy"):
        selector = dig(policy, "spec.podSelector.matchLabels") or {}
        if not selector.items() <= server.labels.items():
            continue
        assert "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        for rule in policy["spec"].get("ingress") or []:
            peers = [_peer(p, envoy_labels) for p in rule.get("from") or []] or [ANYONE]
            ports = [_port(p, server) for p in rule.get("ports") or []] or [EVERY_PORT]
            pairs |= {(peer, port) for peer in peers for port in ports}
    return pairs


def _scraped_ports(manifests: list[Manifest], server: Replica) -> dict[str, int | str]:
    """The container port each endpoint of the replicas' ServiceMonitor reaches, by endpoint
    (ServiceMonitor port name -> Service port -> its targetPort -> the container's port)."""
    ports: dict[str, int | str] = {}
    services = [m for m in manifests if m["kind"] == "Service"]
    for monitor in (m for m in manifests if m["kind"] == "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"].items()
        (service,) = [s for s in services if selector <= s["metadata"]["labels"].items()]
        if not service["spec"]["selector"].items() <= server.labels.items():
            continue  # another Deployment's (Envoy's stats)
        for endpoint in monitor["spec"]["endpoints"]:
            entry = next(p for p in service["spec"]["ports"] if p.get("name") == endpoint["port"])
            target = entry.get("targetPort", entry["port"])
            ports[endpoint["port"]] = server.ports.get(target, target)
    return ports


def envoy_health_check_port(manifests: list[Manifest], server: Replica) -> int:
    """The replica port Envoy's health check asks, as the rendered Envoy ConfigMap says (its
    endpoint's own port where it names no other)."""
    (config,) = [
        yaml.safe_load(m["data"][ENVOY_CONFIG_KEY])
        for m in manifests
        if m["kind"] == "ConfigMap" and ENVOY_CONFIG_KEY in (m.get("data") or {})
    ]
    checked = read_envoy(config)["health_check_port"]
    return server.traffic if checked is None else int(checked)


def access_problems(manifests: list[Manifest]) -> list[str]:
    server = replica(manifests)
    assert server.probes is not None, "the pods set no STEADY_HEALTH_PORT"
    names: dict[int | str, str] = {
        server.traffic: "the traffic port",
        server.probes: "the probe port",
    }
    checked = envoy_health_check_port(manifests, server)
    wanted = {("envoy", server.traffic), ("envoy", checked), ("monitoring", server.probes)}
    got = admitted(manifests)
    problems = [
        f"NetworkPolicy admits {peer} to {port} ({names.get(port, 'not served')})"
        for peer, port in sorted(got - wanted, key=str)
    ]
    problems += [
        f"NetworkPolicy does not admit {peer} to {port} ({names[port]})"
        for peer, port in sorted(wanted - got, key=str)
    ]
    if checked != server.probes:
        problems.append(
            f"Envoy's health check asks port {checked} ({names.get(checked, 'not served')}), "
            f"not the probe port ({server.probes})"
        )
    for endpoint, port in _scraped_ports(manifests, server).items():
        if port != server.probes:
            problems.append(
                f"ServiceMonitor endpoint {endpoint} scrapes port {port}, not the probe port "
                f"({server.probes})"
            )
    return problems


def _rendered(deploy: Path, overlay: str) -> list[Manifest]:
    return render_kustomization(deploy / "k8s" / "overlays" / overlay)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_only_envoy_reaches_the_traffic_port_and_prometheus_scrapes_the_probe_port(
    overlay: str,
) -> None:
    """Envoy's pods reach the probe port too, where their health check asks: the policy let
    them reach `http` alone while the check went to the traffic port, slow under a flood."""
    manifests = _rendered(DEPLOY, overlay)
    assert access_problems(manifests) == []
    # Not vacuous: what is admitted, and where the ServiceMonitor scrapes, exactly.
    assert admitted(manifests) == {("envoy", 8000), ("envoy", 8001), ("monitoring", 8001)}
    assert envoy_health_check_port(manifests, replica(manifests)) == 8001
    assert _scraped_ports(manifests, replica(manifests)) == {"probes": 8001}


_ENVOY_PEER = """        - podSelector:
            matchLabels:
              app.kubernetes.io/name: steadyserve
              app.kubernetes.io/component: envoy
"""
_ENVOY_PROBES = """        - port: probes
          protocol: TCP
    - from:
"""
_MONITORING_RULE = """    - from:
        - namespaceSelector:
            matchLabels:
              kubernetes.io/metadata.name: monitoring
      ports:
        - port: probes
          protocol: TCP
"""


@pytest.mark.parametrize(
    ("file", "old", "new", "named"),
    [
        (  # the policy as it was: monitoring beside Envoy on the traffic port
            "networkpolicy.yaml",
            _ENVOY_PEER,
            _ENVOY_PEER
            + "        - namespaceSelector:\n            matchLabels:\n"
            + "              kubernetes.io/metadata.name: monitoring\n",
            "NetworkPolicy admits monitoring to 8000 (the traffic port)",
        ),
        (
            "networkpolicy.yaml",
            _MONITORING_RULE,
            _MONITORING_RULE.replace("      ports:\n        - port: probes\n", "").replace(
                "          protocol: TCP\n", ""
            ),
            "NetworkPolicy admits monitoring to every port (not served)",
        ),
        (
            "networkpolicy.yaml",
            _MONITORING_RULE,
            _MONITORING_RULE.replace("port: probes", "port: 8000"),
            "NetworkPolicy does not admit monitoring to 8001 (the probe port)",
        ),
        (
            "networkpolicy.yaml",
            _MONITORING_RULE,
            _MONITORING_RULE + "    - ports:\n        - port: http\n",
            "NetworkPolicy admits anyone to 8000 (the traffic port)",
        ),
        (
            "servicemonitor.yaml",
            "    - port: probes\n      path: /metrics\n",
            "    - port: http\n      path: /metrics\n",
            "ServiceMonitor endpoint http scrapes port 8000, not the probe port (8001)",
        ),
        (  # the policy as it was: Envoy's health check could not reach the probe port
            "networkpolicy.yaml",
            _ENVOY_PROBES,
            "    - from:\n",
            "NetworkPolicy does not admit envoy to 8001 (the probe port)",
        ),
    ],
    ids=[
        "monitoring-on-traffic",
        "monitoring-everywhere",
        "no-scrape",
        "anyone",
        "monitor",
        "envoy-health-check-blocked",
    ],
)
def test_a_wider_or_narrower_policy_is_named(
    deploy_copy: Path, file: str, old: str, new: str, named: str
) -> None:
    """The check above can fail: one rule widened (or the scrape moved) in one file."""
    path = deploy_copy / "k8s" / "base" / file
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))
    for overlay in OVERLAYS:
        problems = access_problems(_rendered(deploy_copy, overlay))
        assert named in problems, problems


def test_a_health_check_on_the_traffic_port_is_named(deploy_copy: Path) -> None:
    """The config as it was: no `health_check_config`, so Envoy checked port 8000."""
    path = deploy_copy / "envoy" / "envoy.yaml"
    text = path.read_text()
    line = "                  health_check_config: { port_value: 8001 }\n"
    assert text.count(line) == 1
    path.write_text(text.replace(line, ""))
    for overlay in OVERLAYS:
        problems = access_problems(_rendered(deploy_copy, overlay))
        assert (
            "Envoy's health check asks port 8000 (the traffic port), not the probe port (8001)"
            in problems
        ), problems
