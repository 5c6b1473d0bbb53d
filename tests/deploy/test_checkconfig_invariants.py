"""`steadyserve check-config`'s relations between sources, on each overlay's own values: the
threads the pod runs against the CPUs its engine gets, and the rules between Envoy, the
settings and the manifests that no single baseline value expresses."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.checkconfig_support import check, replace_once

CPU_THREAD_SETTINGS = (
    "      torch_threads: null  # derived: (cpu_limit - 2 front ends) / dispatcher_threads = 2\n"
    "      dispatcher_threads: 1\n"
)


def add_cpu_overlay_settings(deploy: Path, *variables: str) -> None:
    """Add `NAME=value` literals to the CPU overlay's settings ConfigMap."""
    literals = "".join(f"      - {variable}\n" for variable in variables)
    replace_once(
        deploy / "k8s" / "overlays" / "cpu" / "kustomization.yaml",
        "      - STEADY_DEVICE=cpu\n",
        "      - STEADY_DEVICE=cpu\n" + literals,
    )


def test_torch_threads_times_dispatcher_threads_over_the_engines_cpus_fails(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The GPU overlay's old mistake: 2 dispatcher threads, each with the whole 8-CPU limit.
    replace_once(
        deploy_copy / "k8s" / "overlays" / "gpu" / "kustomization.yaml",
        "      - STEADY_DISPATCHER_THREADS=2\n",
        "      - STEADY_DISPATCHER_THREADS=2\n      - STEADY_TORCH_THREADS=8\n",
    )
    replace_once(
        deploy_copy / "baseline.yaml",
        "null  # derived: (cpu_limit - 4 front ends) / dispatcher_threads = 2\n"
        "      dispatcher_threads: 2",
        "8\n      dispatcher_threads: 2",
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert (
        "k8s[gpu].threads: 2 dispatcher threads x 8 torch threads = 16 exceed the engine's "
        "CPUs (4: the CPU limit 8 less one for each of 4 front ends, at least one)" in out
    )
    assert "k8s[cpu]" not in out


def test_a_lower_cpu_limit_fails_an_explicit_thread_count_it_no_longer_holds(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    add_cpu_overlay_settings(deploy_copy, "STEADY_TORCH_THREADS=4")
    patch = deploy_copy / "k8s" / "overlays" / "cpu" / "steadyserve-cpu.yaml"
    text = patch.read_text().replace('cpu: "4"', 'cpu: "2"')
    patch.write_text(text)
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "k8s[cpu].threads: 1 dispatcher threads x 4 torch threads = 4 exceed the engine's" in out


# Threads that fit the pod's 4-CPU limit but not the CPUs its front ends leave the engine:
# (literals for the CPU overlay, its baseline thread settings, the line check-config prints).
THREADS_OVER_THE_ENGINES_SHARE = {
    "torch threads": (
        ["STEADY_TORCH_THREADS=4"],
        "      torch_threads: 4\n      dispatcher_threads: 1\n",
        "1 dispatcher threads x 4 torch threads = 4 exceed the engine's CPUs (2: the CPU limit "
        "4 less one for each of 2 front ends",
    ),
    "dispatcher threads": (
        ["STEADY_DISPATCHER_THREADS=2", "STEADY_FRONTEND_WORKERS=3"],
        "      torch_threads: null\n      dispatcher_threads: 2\n      frontend_workers: 3\n",
        "2 dispatcher threads x 1 torch threads = 2 exceed the engine's CPUs (1: the CPU limit "
        "4 less one for each of 3 front ends",
    ),
}


@pytest.mark.parametrize(
    ("literals", "baseline_settings", "message"),
    THREADS_OVER_THE_ENGINES_SHARE.values(),
    ids=THREADS_OVER_THE_ENGINES_SHARE.keys(),
)
def test_threads_within_the_cpu_limit_but_over_what_the_front_ends_leave_fail(
    literals: list[str],
    baseline_settings: str,
    message: str,
    deploy_copy: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The front ends take a CPU each before the engine's threads get theirs; counted on the
    whole limit, these passed while the engine oversubscribed its share."""
    add_cpu_overlay_settings(deploy_copy, *literals)
    replace_once(deploy_copy / "baseline.yaml", CPU_THREAD_SETTINGS, baseline_settings)
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert out.count("\n") == 2, out  # the one difference and the summary
    assert f"k8s[cpu].threads: {message}" in out


def test_an_overlays_own_keep_alive_is_checked_against_envoys_idle_timeout(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CPU overlay's pods close idle connections at 50 s, before Envoy's 60 s: pinned
    in the baseline for that overlay, so only the relation catches it (it read the shared 75)."""
    add_cpu_overlay_settings(deploy_copy, "STEADY_KEEP_ALIVE_TIMEOUT_S=50")
    replace_once(
        deploy_copy / "baseline.yaml",
        "      device: cpu\n",
        "      device: cpu\n      keep_alive_timeout_s: 50.0\n",
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert (
        "k8s[cpu].envoy.upstream_idle_timeout_s: 60.0 must be below the server's "
        "keep_alive_timeout_s (50)" in out
    )
    assert "k8s[gpu]" not in out


# The GPU overlay scales differently from the shared baseline, through a patch of its own:
# (the patch, its baseline key and value, what Envoy's breakers must then be per Envoy pod).
FLEET_CHANGES = {
    "more replicas": (
        "apiVersion: autoscaling/v2\nkind: HorizontalPodAutoscaler\n"
        "metadata:\n  name: steadyserve\nspec:\n  maxReplicas: 16\n",
        "hpa_max_replicas: 16",
        1024,  # 128 x 16 / 2
    ),
    "more Envoy pods": (
        "apiVersion: apps/v1\nkind: Deployment\n"
        "metadata:\n  name: steadyserve-envoy\nspec:\n  replicas: 4\n",
        "envoy_replicas: 4",
        256,  # 128 x 8 / 4
    ),
}


@pytest.mark.parametrize(
    ("patch", "baseline_entry", "per_envoy"), FLEET_CHANGES.values(), ids=FLEET_CHANGES.keys()
)
def test_an_overlays_own_fleet_is_checked_against_the_circuit_breakers(
    patch: str,
    baseline_entry: str,
    per_envoy: int,
    deploy_copy: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Envoy's breakers (512) were checked against the shared 8 replicas and 2 Envoy pods,
    whatever the overlay deployed."""
    overlay = deploy_copy / "k8s" / "overlays" / "gpu"
    (overlay / "fleet.yaml").write_text(patch)
    replace_once(
        overlay / "kustomization.yaml",
        "  - path: steadyserve-gpu.yaml\n",
        "  - path: steadyserve-gpu.yaml\n  - path: fleet.yaml\n",
    )
    replace_once(
        deploy_copy / "baseline.yaml",
        '      gpu_limit: "1"\n',
        f'      gpu_limit: "1"\n      {baseline_entry}\n',
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for key in ("circuit_breaker_max_requests", "circuit_breaker_max_connections"):
        assert (
            f"k8s[gpu].envoy.{key}: 512 is not capacity.replica_inflight x hpa_max_replicas "
            f"/ envoy_replicas ({per_envoy})" in out
        )
    assert "k8s[cpu]" not in out


def test_an_overlays_own_envoy_config_is_the_one_its_relations_read(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An overlay that ships another envoy.yaml is named as differing, and its relations are
    read from the Envoy it deploys (idle upstream connections kept past the keep-alive)."""
    overlay = deploy_copy / "k8s" / "overlays" / "gpu"
    upstream_idle = "\n" + " " * 12 + "idle_timeout: "  # the cluster's (routes have theirs)
    envoy = (deploy_copy / "envoy" / "envoy.yaml").read_text()
    assert envoy.count(upstream_idle + "60s") == 1
    (overlay / "envoy.yaml").write_text(envoy.replace(upstream_idle + "60s", upstream_idle + "90s"))
    replace_once(
        overlay / "kustomization.yaml",
        "patches:\n",
        "  - name: envoy-config\n    behavior: merge\n    files:\n      - envoy.yaml\npatches:\n",
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "k8s[gpu]: the Envoy ConfigMap differs from deploy/envoy/envoy.yaml" in out
    assert (
        "k8s[gpu].envoy.upstream_idle_timeout_s: 90.0 must be below the server's "
        "keep_alive_timeout_s (75)" in out
    )
    assert "k8s[cpu]" not in out


def base_only(deploy: Path, own_values: bool) -> None:
    """Make `deploy` a tree with only a base (the shipped base is a CPU replica): no
    overlays; the CPU overlay's baseline values become the base's own (`overlays.base`,
    less the device its ConfigMap sets) or, with `own_values` False, its k8s values the
    shared ones and its settings dropped (the baseline has no overlays at all)."""
    shutil.rmtree(deploy / "k8s" / "overlays")
    path = deploy / "baseline.yaml"
    baseline = yaml.safe_load(path.read_text())
    cpu = baseline.pop("overlays")["cpu"]
    if own_values:
        del cpu["settings"]["device"]
        baseline["overlays"] = {"base": cpu}
    else:
        baseline["k8s"].update(cpu["k8s"])
    path.write_text(yaml.safe_dump(baseline))


@pytest.mark.parametrize("own_values", [True, False], ids=["overlays.base", "no overlays"])
def test_a_tree_with_only_a_base_is_checked_as_one_overlay(
    own_values: bool, deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without overlays nothing was rendered, so no relation (nor value) of the base was
    checked: an HPA target no replica can reach passed."""
    base_only(deploy_copy, own_values)
    if own_values:
        assert check(deploy_copy) == 0, capsys.readouterr()
    capsys.readouterr()
    for path, old, new in [
        (
            deploy_copy / "baseline.yaml",
            "hpa_inflight_per_pod: '96'",
            "hpa_inflight_per_pod: '256'",
        ),
        (deploy_copy / "k8s" / "base" / "hpa.yaml", 'averageValue: "96"', 'averageValue: "256"'),
    ]:
        replace_once(path, old, new)
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "k8s[base].hpa_inflight_per_pod: 256 is not under capacity.replica_inflight" in out
    assert "k8s.overlays" not in out


def test_a_base_only_baseline_must_name_every_k8s_field(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """As an overlay's values must: a field left out would pass unchecked."""
    base_only(deploy_copy, own_values=False)
    replace_once(deploy_copy / "baseline.yaml", "  cpu_limit: '4'\n", "")
    assert check(deploy_copy) == 2
    assert "k8s.cpu_limit is missing from the baseline" in capsys.readouterr().err
