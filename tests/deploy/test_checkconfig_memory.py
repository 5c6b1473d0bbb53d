"""`steadyserve check-config` holds the CPU overlay's memory limit to what a replica can hold:
its processes as measured (deploy/baseline.yaml `capacity`) and the bodies of every request
Envoy can have at it at once, with at most as much again on top (requests == limits reserve
it whole on a node). Every figure is read from the shipped files."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.checkconfig_support import check, replace_once

SHIPPED = '              cpu: "4"\n              memory: 4Gi\n'
# 1.13 GB for the engine, the supervisor and 2 front ends (830 + 300 MB), and 2 Envoy pods x
# 512 connections x 1 MiB bodies, each read and parsed: 2 GiB.
SAID = "3.05 GiB: 1.05 GiB for the engine and 2 front ends, measured, + 2.00 GiB of request bodies"


def memory(deploy: Path, amount: str) -> None:
    """The CPU overlay's memory request and limit, and the baseline with them."""
    patch = deploy / "k8s" / "overlays" / "cpu" / "steadyserve-cpu.yaml"
    text = patch.read_text()
    assert text.count(SHIPPED) == 2
    patch.write_text(text.replace(SHIPPED, SHIPPED.replace("4Gi", amount)))
    baseline = deploy / "baseline.yaml"
    replace_once(baseline, "      memory_request: 4Gi\n", f"      memory_request: {amount}\n")
    replace_once(baseline, "      memory_limit: 4Gi\n", f"      memory_limit: {amount}\n")


def test_the_memory_that_was_shipped_reserved_over_twice_what_a_replica_holds(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8Gi against ~0.8 GB measured for every process: reserved, whole, on its node."""
    memory(deploy_copy, "8Gi")
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert f"k8s[cpu].memory_limit: 8Gi is more than twice what a replica can hold ({SAID})" in out
    assert "k8s[gpu]" not in out  # measured on CPU: a GPU replica's host memory is its own


def test_a_limit_under_what_a_replica_can_hold_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory(deploy_copy, "3Gi")
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert f"k8s[cpu].memory_limit: 3Gi is under what a replica can hold ({SAID})" in out


def test_more_front_ends_need_more(deploy_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The bounds follow the overlay's own values: 8 front ends add 1.8 GB, past 4Gi."""
    replace_once(
        deploy_copy / "k8s" / "overlays" / "cpu" / "kustomization.yaml",
        "      - STEADY_DEVICE=cpu\n",
        "      - STEADY_DEVICE=cpu\n      - STEADY_FRONTEND_WORKERS=8\n",
    )
    replace_once(
        deploy_copy / "baseline.yaml",
        "      device: cpu\n",
        "      device: cpu\n      frontend_workers: 8\n",
    )
    assert check(deploy_copy) == 1
    assert (
        "k8s[cpu].memory_limit: 4Gi is under what a replica can hold (4.73 GiB: 2.73 GiB for "
        "the engine and 8 front ends, measured, + 2.00 GiB of request bodies)"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "lots", "true"])
def test_a_measured_figure_that_is_no_amount_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    replace_once(
        deploy_copy / "baseline.yaml", "frontend_resident_mb: 300", f"frontend_resident_mb: {value}"
    )
    assert check(deploy_copy) == 2
    assert "capacity.frontend_resident_mb must be a positive number" in capsys.readouterr().err
