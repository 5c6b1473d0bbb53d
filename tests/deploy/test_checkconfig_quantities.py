"""`steadyserve check-config` compares Kubernetes quantities by the amounts they stand for:
"4", 4 and "4000m" CPUs are one limit, "4Gi" and "4096Mi" one memory size."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.checkconfig_support import check, replace_once

SHIPPED_CPU_RESOURCES = (
    "            requests:\n"
    '              cpu: "4"\n'
    "              memory: 4Gi\n"
    "            limits:\n"
    '              cpu: "4"\n'
    "              memory: 4Gi\n"
)


def cpu_overlay_patch(deploy: Path) -> Path:
    return deploy / "k8s" / "overlays" / "cpu" / "steadyserve-cpu.yaml"


def test_other_spellings_of_the_same_resources_match_the_baseline(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        cpu_overlay_patch(deploy_copy),
        SHIPPED_CPU_RESOURCES,
        "            requests:\n"
        '              cpu: "4000m"\n'
        "              memory: 4096Mi\n"
        "            limits:\n"
        "              cpu: 4\n"
        "              memory: 4Gi\n",
    )
    assert check(deploy_copy) == 0, capsys.readouterr().out


def test_requests_left_out_are_the_limits(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Kubernetes sets a missing request to the limit: still Guaranteed QoS, still 4 CPUs."""
    replace_once(
        cpu_overlay_patch(deploy_copy),
        SHIPPED_CPU_RESOURCES,
        "            requests: null\n"
        "            limits:\n"
        '              cpu: "4"\n'
        "              memory: 4Gi\n",
    )
    assert check(deploy_copy) == 0, capsys.readouterr().out


def test_a_different_amount_is_still_drift(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        cpu_overlay_patch(deploy_copy),
        '              cpu: "4"\n              memory: 4Gi\n            limits:',
        '              cpu: "3500m"\n              memory: 4Gi\n            limits:',
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert 'k8s[cpu].cpu_request: baseline "4", actual "3500m"' in out
    assert "k8s[cpu].cpu_request: 3500m is not the limit (4): Guaranteed QoS" in out


def test_an_hpa_target_in_milli_units_is_read(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "base" / "hpa.yaml", 'averageValue: "96"', 'averageValue: "96000m"'
    )
    replace_once(
        deploy_copy / "baseline.yaml",
        'hpa_inflight_per_pod: "96"',
        'hpa_inflight_per_pod: "96000m"',
    )
    assert check(deploy_copy) == 0, capsys.readouterr().out


# An HPA target the checker cannot take as an amount is a config error (exit 2, on stderr);
# a 400-digit integer is still one (it raised OverflowError: only floats are infinite).
UNUSUAL_TARGETS = {
    "not a quantity": (
        '"96 pods"',
        2,
        "overlay cpu: k8s[cpu].hpa_inflight_per_pod: '96 pods' is not a Kubernetes quantity",
    ),
    "infinite": (".inf", 2, "inf is not a Kubernetes quantity"),
    "beyond a float": ("1" + "0" * 400, 1, "k8s[cpu].hpa_inflight_per_pod: baseline"),
}


@pytest.mark.parametrize(
    ("value", "status", "message"), UNUSUAL_TARGETS.values(), ids=UNUSUAL_TARGETS.keys()
)
def test_an_unusual_hpa_target_is_an_error_or_drift_never_a_traceback(
    value: str, status: int, message: str, deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "base" / "hpa.yaml", 'averageValue: "96"', f"averageValue: {value}"
    )
    assert check(deploy_copy) == status
    captured = capsys.readouterr()
    assert message in (captured.err if status == 2 else captured.out)
