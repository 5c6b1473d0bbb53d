"""`steadyserve check-config`'s relations between sources, on each overlay's own values: the
threads the pod runs against the CPUs its engine gets, and the rules between Envoy, the
settings and the manifests that no single baseline value expresses."""

from __future__ import annotations

from pathlib import Path

import pytest

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
