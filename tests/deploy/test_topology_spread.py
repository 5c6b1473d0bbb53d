"""The hard topology spread of every Deployment, played out on a mixed cluster: a tainted
control-plane node, CPU workers and tainted GPU nodes (labelled as NVIDIA's GPU Feature
Discovery labels them). Each Deployment must be able to run two pods on every node it may run
on. Kubernetes counts, by default, every node with the topology key as a spread domain, even
one the pod can never land on (tainted, or, for a GPU replica, a CPU node): such a node holds
zero pods forever, so `maxSkew: 1` allowed one pod per node and left the rest Pending.

`schedule` follows the scheduler's PodTopologySpread filter (pkg/scheduler/framework/plugins/
podtopologyspread): domains are the nodes that carry the topology key and, per the
constraint's nodeAffinityPolicy (default Honor) and nodeTaintsPolicy (default Ignore), match
the pod's node selector / required affinity and tolerate the node's taints; a node is feasible
when its domain's matching pods + 1 - the smallest domain's count <= maxSkew. All pods here are
one revision, so `matchLabelKeys: [pod-template-hash]` changes nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from app.checkconfig import render_kustomization
from tests.deploy.tools import DEPLOY

GPU = "nvidia.com/gpu"
HOSTNAME = "kubernetes.io/hostname"


@dataclass
class Node:
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    taints: list[dict[str, str]] = field(default_factory=list)
    gpus: int = 0
    pods: int = 0

    def __post_init__(self) -> None:
        self.labels[HOSTNAME] = self.name


def mixed_cluster() -> list[Node]:
    gpu_taint = {"key": GPU, "value": "present", "effect": "NoSchedule"}
    gpu_labels = {f"{GPU}.present": "true"}
    return [
        Node(
            "control-plane",
            taints=[{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"}],
        ),
        Node("cpu-1"),
        Node("cpu-2"),
        Node("gpu-1", labels=dict(gpu_labels), taints=[gpu_taint], gpus=4),
        Node("gpu-2", labels=dict(gpu_labels), taints=[gpu_taint], gpus=4),
    ]


def _tolerates(pod: dict[str, Any], node: Node) -> bool:
    """Every NoSchedule / NoExecute taint of the node has a toleration (Kubernetes' rules: no
    effect matches every effect; Exists without a key matches every key)."""

    def matches(toleration: dict[str, str], taint: dict[str, str]) -> bool:
        if toleration.get("effect") not in (None, "", taint["effect"]):
            return False
        if toleration.get("operator", "Equal") == "Exists":
            return toleration.get("key") in (None, "", taint["key"])
        key, value = toleration.get("key"), toleration.get("value")
        return key == taint["key"] and value == taint.get("value")

    tolerations = pod.get("tolerations") or []
    return all(
        any(matches(toleration, taint) for toleration in tolerations)
        for taint in node.taints
        if taint["effect"] in ("NoSchedule", "NoExecute")
    )


def _selected(pod: dict[str, Any], node: Node) -> bool:
    """The pod's nodeSelector and required node affinity (In / Exists) admit the node."""
    if any(node.labels.get(k) != v for k, v in (pod.get("nodeSelector") or {}).items()):
        return False
    required = (
        (pod.get("affinity") or {})
        .get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if required is None:
        return True

    def matches(expression: dict[str, Any]) -> bool:
        operator, key = expression["operator"], expression["key"]
        assert operator in ("In", "Exists"), f"the model knows In and Exists, not {operator}"
        if operator == "Exists":
            return key in node.labels
        return node.labels.get(key) in expression["values"]

    return any(
        all(matches(e) for e in term.get("matchExpressions", []))
        for term in required["nodeSelectorTerms"]
    )


def _gpus_requested(pod: dict[str, Any]) -> int:
    return sum(int(c["resources"].get("limits", {}).get(GPU, 0)) for c in pod["containers"])


def _feasible(pod: dict[str, Any], node: Node) -> bool:
    """Every filter but the spread: selector, taints, GPUs."""
    return _selected(pod, node) and _tolerates(pod, node) and node.gpus >= _gpus_requested(pod)


def _spread_allows(pod: dict[str, Any], nodes: list[Node], candidate: Node) -> bool:
    for constraint in pod.get("topologySpreadConstraints") or []:
        if constraint["whenUnsatisfiable"] != "DoNotSchedule":
            continue
        key = constraint["topologyKey"]
        if key not in candidate.labels:
            return False
        counted = [
            node
            for node in nodes
            if key in node.labels
            and (constraint.get("nodeAffinityPolicy", "Honor") == "Ignore" or _selected(pod, node))
            and (constraint.get("nodeTaintsPolicy", "Ignore") == "Ignore" or _tolerates(pod, node))
        ]
        per_domain: dict[str, int] = {}
        for node in counted:
            domain = node.labels[key]
            per_domain[domain] = per_domain.get(domain, 0) + node.pods
        smallest = min(per_domain.values()) if per_domain else 0
        if per_domain.get(candidate.labels[key], 0) + 1 - smallest > constraint["maxSkew"]:
            return False
    return True


def schedule(pod: dict[str, Any], nodes: list[Node], count: int) -> list[str]:
    """Place `count` pods one at a time (the least loaded feasible node first); the nodes
    they land on, fewer than `count` where the rest would stay Pending."""
    placed: list[str] = []
    for _ in range(count):
        candidates = [n for n in nodes if _feasible(pod, n) and _spread_allows(pod, nodes, n)]
        if not candidates:
            break
        chosen = min(candidates, key=lambda n: (n.pods, n.name))
        chosen.pods += 1
        chosen.gpus -= _gpus_requested(pod)
        placed.append(chosen.name)
    return placed


def pod_spec(overlay: str, deployment: str) -> dict[str, Any]:
    manifests = render_kustomization(DEPLOY / "k8s" / "overlays" / overlay)
    found = next(
        m for m in manifests if m["kind"] == "Deployment" and m["metadata"]["name"] == deployment
    )
    spec: dict[str, Any] = found["spec"]["template"]["spec"]
    return spec


CASES = [
    # (overlay, Deployment, the nodes its pods may run on)
    ("cpu", "steadyserve", {"cpu-1", "cpu-2"}),
    ("cpu", "steadyserve-envoy", {"cpu-1", "cpu-2"}),
    ("gpu", "steadyserve", {"gpu-1", "gpu-2"}),
    ("gpu", "steadyserve-envoy", {"cpu-1", "cpu-2"}),
]


@pytest.mark.parametrize(("overlay", "deployment", "eligible"), CASES)
def test_nodes_a_pod_cannot_run_on_do_not_cap_its_spread(
    overlay: str, deployment: str, eligible: set[str]
) -> None:
    pod = pod_spec(overlay, deployment)
    nodes = mixed_cluster()
    assert {n.name for n in nodes if _feasible(pod, n)} == eligible
    placed = schedule(pod, nodes, 2 * len(eligible))
    assert sorted(placed) == sorted(2 * list(eligible)), placed


def test_the_model_reproduces_the_pending_replicas_of_a_spread_that_counts_every_node() -> None:
    """The check above can fail: with Kubernetes' defaults (no policies: tainted nodes count)
    and no GPU node selector, the CPU nodes cap the GPU replicas at one per GPU node."""
    pod = pod_spec("gpu", "steadyserve")
    pod.pop("nodeSelector")
    for constraint in pod["topologySpreadConstraints"]:
        constraint.pop("nodeAffinityPolicy")
        constraint.pop("nodeTaintsPolicy")
    assert sorted(schedule(pod, mixed_cluster(), 4)) == ["gpu-1", "gpu-2"]


def test_gpu_replicas_select_the_gpu_feature_discovery_label() -> None:
    """deploy/README.md tells clusters that label GPU nodes otherwise to patch this."""
    assert pod_spec("gpu", "steadyserve")["nodeSelector"] == {f"{GPU}.present": "true"}
    assert "nodeSelector" not in pod_spec("cpu", "steadyserve")
