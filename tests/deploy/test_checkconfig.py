"""`steadyserve check-config` (app/checkconfig/): passes on the shipped files and fails,
naming the field and both values, when any one source drifts from deploy/baseline.yaml."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.deploy.checkconfig_support import check, replace_once
from tests.deploy.tools import DEPLOY
from tests.support.server import REPO_ROOT


def test_shipped_configuration_matches_the_baseline(capsys: pytest.CaptureFixture[str]) -> None:
    assert check(DEPLOY) == 0
    assert "configuration matches" in capsys.readouterr().out


@pytest.mark.parametrize(
    "command",
    [["-m", "app.checkconfig"], ["-m", "app.cli", "check-config"]],
    ids=["module", "steadyserve-check-config"],
)
def test_command_line_passes_from_the_repository_root(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, *command],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        # No STEADY_* variables: the defaults are what the baseline pins.
        env={"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "configuration matches" in result.stdout


def test_envoy_reuse_limit_drift_is_named(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "envoy" / "envoy.yaml",
        "max_requests_per_connection: 5000",
        "max_requests_per_connection: 100",
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "envoy.downstream_max_requests_per_connection: baseline 5000, actual 100" in out


def test_deprecated_upstream_reuse_field_is_drift(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "envoy" / "envoy.yaml",
        "      lb_policy: LEAST_REQUEST\n",
        "      lb_policy: LEAST_REQUEST\n      max_requests_per_connection: 10\n",
    )
    assert check(deploy_copy) == 1
    assert "envoy.deprecated_cluster_max_requests_per_connection" in capsys.readouterr().out


def test_config_map_setting_drift_is_named_for_every_overlay(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "STEADY_MAX_INFLIGHT=512",
        "STEADY_MAX_INFLIGHT=2048",
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for overlay in ("cpu", "gpu"):
        assert f"k8s[{overlay}].settings.max_inflight: baseline 512, actual 2048" in out


def test_cpu_limit_change_is_named_with_the_thread_count_it_implies(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = deploy_copy / "k8s" / "overlays" / "cpu" / "steadyserve-cpu.yaml"
    replace_once(
        patch,
        'limits:\n              cpu: "4"\n              memory: 4Gi',
        'limits:\n              cpu: "6"\n              memory: 4Gi',
    )
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert 'k8s[cpu].cpu_limit: baseline "4", actual "6"' in out
    assert "k8s[gpu]" not in out


def test_probe_timing_drift_is_named(deploy_copy: Path, capsys: pytest.CaptureFixture[str]) -> None:
    replace_once(
        deploy_copy / "k8s" / "overlays" / "gpu" / "steadyserve-gpu.yaml",
        "failureThreshold: 120",
        "failureThreshold: 12",
    )
    assert check(deploy_copy) == 1
    assert (
        "k8s[gpu].startup_probe_failure_threshold: baseline 120, actual 12"
        in capsys.readouterr().out
    )


def test_grace_period_shorter_than_the_drain_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Changed in both places, so only the invariant between sources catches it."""
    replace_once(
        deploy_copy / "k8s" / "base" / "steadyserve-deployment.yaml",
        "terminationGracePeriodSeconds: 85",
        "terminationGracePeriodSeconds: 65",
    )
    replace_once(
        deploy_copy / "baseline.yaml",
        "termination_grace_period_s: 85",
        "termination_grace_period_s: 65",
    )
    assert check(deploy_copy) == 1
    assert "must exceed pre_stop_sleep_s (10) + drain_timeout_s (60.0)" in capsys.readouterr().out


def test_a_grace_period_without_time_to_stop_after_the_drain_differs(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Over preStop + drain (70 s) but not over the server's stop after it: the kubelet's
    SIGKILL would cut the stop of hung processes short."""
    for path, key in (
        (
            deploy_copy / "k8s" / "base" / "steadyserve-deployment.yaml",
            "terminationGracePeriodSeconds",
        ),
        (deploy_copy / "baseline.yaml", "termination_grace_period_s"),
    ):
        replace_once(path, f"{key}: 85", f"{key}: 80")
    assert check(deploy_copy) == 1
    assert "the server's 12 s to stop its processes" in capsys.readouterr().out


def test_unknown_setting_in_the_config_map_is_named(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "      - STEADY_WARMUP=true\n",
        "      - STEADY_WARMUP=true\n      - STEADY_MAX_INFLIGHTS=1\n",
    )
    assert check(deploy_copy) == 1
    assert "STEADY_MAX_INFLIGHTS is not a setting" in capsys.readouterr().out


def test_process_environment_drift_is_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEADY_MAX_QUEUE", "8192")
    assert check(DEPLOY) == 1
    assert "settings.max_queue: baseline 4096, actual 8192" in capsys.readouterr().out


def test_baseline_key_that_nothing_reads_is_an_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(deploy_copy / "baseline.yaml", "  num_retries: 2\n", "  num_retrys: 2\n")
    assert check(deploy_copy) == 2
    err = capsys.readouterr().err
    assert "envoy.num_retrys is not read" in err
    assert "envoy.num_retries is read by check-config but missing" in err


def test_upstream_idle_timeout_at_or_above_server_keep_alive_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Changed in both places, so only the invariant between sources catches it."""
    upstream_idle = "\n" + " " * 12 + "idle_timeout: "  # the cluster's (routes have theirs)
    replace_once(deploy_copy / "envoy" / "envoy.yaml", upstream_idle + "60s", upstream_idle + "90s")
    replace_once(
        deploy_copy / "baseline.yaml",
        "upstream_idle_timeout_s: 60.0",
        "upstream_idle_timeout_s: 90.0",
    )
    assert check(deploy_copy) == 1
    assert (
        "envoy.upstream_idle_timeout_s: 90.0 must be below the server's keep_alive_timeout_s (75)"
        in capsys.readouterr().out
    )


def test_circuit_breaker_sized_by_admission_caps_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The old sizing (max_inflight 512 x 8 replicas = 4096) let Envoy pile seconds of work
    onto the replicas; so did 1024 on each of two Envoy pods (each enforces its own).
    Changed in both places, so only the sizing rule catches it."""
    for path in (deploy_copy / "envoy" / "envoy.yaml", deploy_copy / "baseline.yaml"):
        text = path.read_text()
        assert text.count("max_requests: 512") == 1
        path.write_text(text.replace("max_requests: 512", "max_requests: 1024"))
    assert check(deploy_copy) == 1
    assert (
        "envoy.circuit_breaker_max_requests: 1024 is not capacity.replica_inflight x "
        "hpa_max_replicas / envoy_replicas (512)" in capsys.readouterr().out
    )


def test_replica_capacity_above_the_replica_admission_cap_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(deploy_copy / "baseline.yaml", "replica_inflight: 128", "replica_inflight: 600")
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert (
        "capacity.replica_inflight: 600 exceeds max_inflight (512), each front end's own cap" in out
    )
    # The breakers no longer match the product either.
    assert "envoy.circuit_breaker_max_connections: 512 is not" in out


def test_an_hpa_target_a_replica_cannot_reach_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """At 256 per pod (the old target) a replica sheds at ~128 and Envoy lets 128 per
    replica through: the in-flight metric could never add a replica."""
    baseline, hpa = deploy_copy / "baseline.yaml", deploy_copy / "k8s" / "base" / "hpa.yaml"
    replace_once(baseline, 'hpa_inflight_per_pod: "96"', 'hpa_inflight_per_pod: "256"')
    replace_once(hpa, 'averageValue: "96"', 'averageValue: "256"')
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for overlay in ("cpu", "gpu"):
        assert (
            f"k8s[{overlay}].hpa_inflight_per_pod: 256 is not under capacity.replica_inflight"
            in out
        )


def test_a_generation_route_longer_than_the_server_allows_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The OpenAI generation routes share one route (a YAML alias): both are named."""
    replace_once(deploy_copy / "envoy" / "envoy.yaml", " timeout: 60s\n", " timeout: 90s\n")
    for key in ("completions_route_timeout_s", "chat_route_timeout_s"):
        replace_once(deploy_copy / "baseline.yaml", f"{key}: 60.0", f"{key}: 90.0")
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for key in ("completions_route_timeout_s", "chat_route_timeout_s"):
        assert f"envoy.{key}: 90.0 exceeds the server's max_timeout_ms (60000)" in out


def test_a_generation_route_reset_by_the_stream_idle_timeout_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without its own idle timeout a generation route keeps the listener's 30 s, and a
    whole answer taking longer was reset before the route's 60 s."""
    route_idle = " " * 28 + "idle_timeout: 60s\n"
    replace_once(deploy_copy / "envoy" / "envoy.yaml", route_idle, "")
    for key in ("completions_route_idle_timeout_s", "chat_route_idle_timeout_s"):
        replace_once(deploy_copy / "baseline.yaml", f"{key}: 60.0", f"{key}: null")
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    for route in ("completions_route", "chat_route"):
        assert (
            f"envoy.{route}_idle_timeout_s: 30.0 (the stream idle timeout it gets) is under" in out
        )


def test_pending_queue_larger_than_a_replica_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "envoy" / "envoy.yaml",
        "max_pending_requests: 32",
        "max_pending_requests: 512",
    )
    replace_once(
        deploy_copy / "baseline.yaml",
        "circuit_breaker_max_pending_requests: 32",
        "circuit_breaker_max_pending_requests: 512",
    )
    assert check(deploy_copy) == 1
    assert (
        "envoy.circuit_breaker_max_pending_requests: 512 exceeds capacity.replica_inflight (128)"
        in capsys.readouterr().out
    )


def test_capacity_key_that_nothing_reads_is_an_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(deploy_copy / "baseline.yaml", "replica_inflight: 128", "replica_inflights: 128")
    assert check(deploy_copy) == 2
    err = capsys.readouterr().err
    assert "capacity.replica_inflights is not read" in err
    assert "capacity.replica_inflight is read by check-config but missing" in err


def test_a_drain_shorter_than_the_longest_deadline_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A generation admitted just before SIGTERM may run STEADY_MAX_TIMEOUT_MS (60 s, its
    route's too): a 20 s drain (and a grace period sized for it) cut it. Changed everywhere:
    the server refuses such settings, and check-config with it."""
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "STEADY_DRAIN_TIMEOUT_S=60",
        "STEADY_DRAIN_TIMEOUT_S=20",
    )
    replace_once(deploy_copy / "baseline.yaml", "drain_timeout_s: 60.0", "drain_timeout_s: 20.0")
    assert check(deploy_copy) == 2
    err = capsys.readouterr().err
    assert "drain_timeout_s must be at least max_timeout_ms" in err


def test_a_drain_shorter_than_the_longest_route_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A route over the server's longest deadline (itself refused) is also over the drain:
    a request admitted just before SIGTERM may run the route's 90 s."""
    replace_once(deploy_copy / "envoy" / "envoy.yaml", " timeout: 60s\n", " timeout: 90s\n")
    for key in ("completions_route_timeout_s", "chat_route_timeout_s"):
        replace_once(deploy_copy / "baseline.yaml", f"{key}: 60.0", f"{key}: 90.0")
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "settings.drain_timeout_s: 60.0 is under the longest Envoy route timeout (90.0)" in out


def test_memory_requests_below_limits_are_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The comments promised Guaranteed QoS with memory requested below its limit (6 of 8
    GiB): Burstable, and no exclusive cores. Changed in both places: the invariant catches it."""
    replace_once(
        deploy_copy / "k8s" / "overlays" / "cpu" / "steadyserve-cpu.yaml",
        '              cpu: "4"\n              memory: 4Gi\n            limits:',
        '              cpu: "4"\n              memory: 3Gi\n            limits:',
    )
    baseline = deploy_copy / "baseline.yaml"
    text = baseline.read_text()
    baseline.write_text(text.replace("memory_request: 4Gi", "memory_request: 3Gi", 1))
    assert check(deploy_copy) == 1
    assert "k8s[cpu].memory_request: 3Gi is not the limit (4Gi)" in capsys.readouterr().out


def test_probes_on_a_port_the_server_does_not_answer_them_on_are_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """STEADY_HEALTH_PORT moved (and the baseline with it) while the probes still named the
    old container port: check-config said it matched, and the pods restarted forever. Envoy's
    health check, left on the old port, found nothing there: every replica out."""
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "STEADY_HEALTH_PORT=8001",
        "STEADY_HEALTH_PORT=9001",
    )
    baseline = deploy_copy / "baseline.yaml"
    baseline.write_text(baseline.read_text().replace("health_port: 8001", "health_port: 9001"))
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert "startup_probe port: 8001 is not the port the server answers probes on (9001" in out
    assert "k8s[cpu].envoy.health_check_port: 8001 is not the probe port (9001" in out


def test_a_replica_count_on_the_autoscaled_deployment_is_refused(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An apply of a manifest naming `replicas` resets what the HPA scaled to."""
    replace_once(
        deploy_copy / "k8s" / "base" / "steadyserve-deployment.yaml",
        "  revisionHistoryLimit: 5",
        "  replicas: 2\n  revisionHistoryLimit: 5",
    )
    assert check(deploy_copy) == 1
    assert "deployment_replicas" in capsys.readouterr().out
    # With the baseline changed to match, the rule itself still refuses it.
    baseline = deploy_copy / "baseline.yaml"
    replace_once(baseline, "deployment_replicas: null", "deployment_replicas: 2")
    assert check(deploy_copy) == 1
    assert "every kubectl apply resets the replica count" in capsys.readouterr().out
