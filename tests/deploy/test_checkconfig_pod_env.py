"""`steadyserve check-config` reads every variable the server would read as a setting, from
wherever Kubernetes takes it, and names one it cannot read instead of passing over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from app.settings import Settings
from tests.deploy.checkconfig_support import check, edit_server_container, replace_once


def test_a_lower_case_setting_name_is_read(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pydantic-settings matches names ignoring case: the server runs with 2048."""
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "STEADY_MAX_INFLIGHT=512",
        "steady_max_inflight=2048",
    )
    assert check(deploy_copy) == 1
    assert "k8s[cpu].settings.max_inflight: baseline 512, actual 2048" in capsys.readouterr().out


def test_an_env_from_prefix_is_applied(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prefixed, no ConfigMap key is a setting any more: the pod runs on the defaults."""

    def add_prefix(container: dict[str, Any]) -> None:
        container["envFrom"][0]["prefix"] = "APP_"

    edit_server_container(deploy_copy, add_prefix)
    assert check(deploy_copy) == 1
    out = capsys.readouterr().out
    assert 'k8s[cpu].settings.device: baseline "cpu", actual "auto"' in out


def test_a_config_map_key_reference_is_resolved(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The env entry wins over envFrom; its value is another key of the generated ConfigMap
    (referenced by its unhashed name, renamed as kustomize renames it)."""

    def reference_max_queue(container: dict[str, Any]) -> None:
        reference = {"name": "steadyserve-settings", "key": "STEADY_MAX_QUEUE"}
        container["env"].append(
            {"name": "STEADY_MAX_INFLIGHT", "valueFrom": {"configMapKeyRef": reference}}
        )

    edit_server_container(deploy_copy, reference_max_queue)
    assert check(deploy_copy) == 1
    assert "k8s[cpu].settings.max_inflight: baseline 512, actual 4096" in capsys.readouterr().out


def test_a_setting_from_a_source_it_cannot_read_is_named(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def token_from_secret(container: dict[str, Any]) -> None:
        reference = {"name": "steadyserve-debug", "key": "token"}
        container["env"].append(
            {"name": "STEADY_DEBUG_TOKEN", "valueFrom": {"secretKeyRef": reference}}
        )

    edit_server_container(deploy_copy, token_from_secret)
    assert check(deploy_copy) == 1
    assert (
        "k8s[cpu].settings: STEADY_DEBUG_TOKEN is set from secretKeyRef, which check-config "
        "cannot read" in capsys.readouterr().out
    )


def test_settings_from_a_secret_are_named_as_unchecked(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def add_secret(container: dict[str, Any]) -> None:
        container["envFrom"].append({"secretRef": {"name": "steadyserve-extra"}})

    edit_server_container(deploy_copy, add_secret)
    assert check(deploy_copy) == 1
    assert (
        "k8s[cpu].settings: envFrom secretRef steadyserve-extra is not checked"
        in capsys.readouterr().out
    )


def test_values_need_no_none_string_mapping() -> None:
    """check-config reads the pod's variables as pydantic-settings does, without mapping an
    `env_parse_none_str` (its private helper would): Settings must not set one."""
    assert Settings.model_config.get("env_parse_none_str") is None


def test_a_secret_whose_prefix_rules_out_settings_is_not_reported(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def add_secret(container: dict[str, Any]) -> None:
        container["envFrom"].append({"secretRef": {"name": "db"}, "prefix": "DB_"})

    edit_server_container(deploy_copy, add_secret)
    assert check(deploy_copy) == 0, capsys.readouterr().out


def test_a_setting_the_baseline_does_not_pin_is_named(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """It passed unseen: in-process, the probes answer from the loop the traffic floods."""
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "      - STEADY_LOG_LEVEL=info\n",
        "      - STEADY_LOG_LEVEL=info\n      - STEADY_ENGINE=inprocess\n",
    )
    assert check(deploy_copy) == 1
    assert (
        "k8s[cpu].settings.engine: set by the pod (STEADY_ENGINE), not pinned in the baseline"
        in capsys.readouterr().out
    )


def test_the_containers_serve_flags_win_over_its_environment(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The container runs `serve --host 0.0.0.0 --port 8000`, whose --port wins over
    STEADY_PORT=9000: the probe port is the traffic port, and the server refuses to start.
    check-config read the environment only, and passed it (everything else moved along)."""
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "STEADY_HEALTH_PORT=8001\n",
        "STEADY_HEALTH_PORT=8000\n      - STEADY_PORT=9000\n",
    )
    baseline = deploy_copy / "baseline.yaml"
    text = baseline.read_text()
    assert text.count("health_port: 8001") == 2
    baseline.write_text(text.replace("health_port: 8001", "health_port: 8000\n      port: 9000"))

    def move_ports(container: dict[str, Any]) -> None:
        ports = {port["name"]: port for port in container["ports"]}
        ports["http"]["containerPort"], ports["probes"]["containerPort"] = 9000, 8000

    edit_server_container(deploy_copy, move_ports)
    assert check(deploy_copy) == 2
    assert (
        "overlay cpu: the settings together do not validate: health_port must differ from port "
        "(it carries no traffic) (with the flags of `steadyserve serve --host 0.0.0.0 --port "
        "8000`, which win)" in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["serve", "--host", "0.0.0.0", "--port", "70000"],
            "--port of `steadyserve serve --host 0.0.0.0 --port 70000` does not validate: "
            "Input should be less than or equal to 65535",
        ),
        (
            ["serve", "--port", "http"],
            "`steadyserve serve --port http` would not serve: argument --port: invalid int "
            "value: 'http'",
        ),
        (
            ["serve", "--workers", "4"],
            "`steadyserve serve --workers 4` would not serve: unrecognized arguments: --workers 4",
        ),
        (["bench"], "`steadyserve bench` would not serve: it runs `bench`, not `serve`"),
    ],
)
def test_a_serve_command_line_the_server_refuses_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    def set_args(container: dict[str, Any]) -> None:
        container["args"] = args

    edit_server_container(deploy_copy, set_args)
    assert check(deploy_copy) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("command", "line"),
    [
        (["python", "-m", "app.cli"], "runs ['python', '-m', 'app.cli'], not steadyserve"),
        (None, "sets no args: the image's CMD, which check-config cannot read"),
    ],
)
def test_a_command_line_it_cannot_read_is_named(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str], command: list[str] | None, line: str
) -> None:
    def set_command(container: dict[str, Any]) -> None:
        container.pop("args")
        if command is not None:
            container["command"] = command

    edit_server_container(deploy_copy, set_command)
    assert check(deploy_copy) == 1
    assert f"k8s[cpu].settings: the server container {line}" in capsys.readouterr().out


def test_an_entry_point_named_by_path_reads_its_flags(deploy_copy: Path) -> None:
    def by_path(container: dict[str, Any]) -> None:
        container["command"] = ["/opt/venv/bin/steadyserve", "serve"]
        container["args"] = ["--host", "0.0.0.0", "--port", "8000"]

    edit_server_container(deploy_copy, by_path)
    assert check(deploy_copy) == 0
