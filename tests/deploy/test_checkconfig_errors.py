"""`steadyserve check-config` on files it cannot check: one clear line on stderr and exit
status 2 (a config error), never a traceback, and never 1, which means "drift found"."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.deploy.checkconfig_support import check, edit_server_container, replace_once
from tests.deploy.tools import DEPLOY


def config_error(capsys: pytest.CaptureFixture[str]) -> str:
    """The one line check-config wrote to stderr."""
    err = capsys.readouterr().err
    assert err.startswith("check-config: ") and err.count("\n") == 1, err
    return err


def test_malformed_kustomization_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "configMapGenerator:\n",
        "configMapGenerator: [\n",
    )
    assert check(deploy_copy) == 2
    err = config_error(capsys)
    assert "overlay cpu:" in err and "base/kustomization.yaml:" in err


def test_manifest_without_a_name_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(deploy_copy / "k8s" / "base" / "hpa.yaml", "\n  name: steadyserve\n", "\n")
    assert check(deploy_copy) == 2
    assert "hpa.yaml: a HorizontalPodAutoscaler has no metadata.name" in config_error(capsys)


def test_patch_without_a_name_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patch = deploy_copy / "k8s" / "overlays" / "cpu" / "steadyserve-cpu.yaml"
    replace_once(patch, "metadata:\n  name: steadyserve\n", "metadata: {}\n")
    assert check(deploy_copy) == 2
    assert "steadyserve-cpu.yaml: a Deployment has no metadata.name" in config_error(capsys)


def test_text_setting_that_looks_like_json_is_read_as_text(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """pydantic-settings parses JSON only for list and object fields: the server takes this
    token as it is, and so must the checker."""
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "      - STEADY_WARMUP=true\n",
        "      - STEADY_WARMUP=true\n      - STEADY_DEBUG_TOKEN={abc\n",
    )
    for device in ("cpu", "cuda"):  # pinned as text where each overlay's settings are
        replace_once(
            deploy_copy / "baseline.yaml",
            f"      device: {device}\n",
            f'      device: {device}\n      debug_token: "{{abc"\n',
        )
    assert check(deploy_copy) == 0, capsys.readouterr()


def test_list_setting_that_is_not_json_in_the_config_map_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "base" / "kustomization.yaml",
        "STEADY_LENGTH_BUCKETS=[16,32,64,128,256,512]",
        "STEADY_LENGTH_BUCKETS=16,32,64,128,256,512",
    )
    assert check(deploy_copy) == 2
    err = config_error(capsys)
    assert "overlay cpu: STEADY_LENGTH_BUCKETS is not the JSON its setting's type needs" in err


def test_list_setting_that_is_not_json_in_this_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEADY_LENGTH_BUCKETS", "16,32")
    assert check(DEPLOY) == 2
    err = config_error(capsys)
    assert "this environment: STEADY_LENGTH_BUCKETS is not the JSON its setting's type" in err


# Settings that parse but fail validation: the server would not start, so a config error (it
# was a many-line "difference", exit 1), naming the overlay and the variable.
INVALID_OVERLAY_SETTINGS = {
    "out of range": (
        "gpu",
        "STEADY_MAX_INFLIGHT=0",
        'overlay gpu: STEADY_MAX_INFLIGHT="0" does not validate: Input should be greater than '
        "or equal to 1",
    ),
    "a rule between settings": (
        "cpu",
        "STEADY_RATE_LIMIT_BURST=1",
        "overlay cpu: the settings together do not validate: rate_limit_burst must hold",
    ),
}


@pytest.mark.parametrize(
    ("overlay", "literal", "message"),
    INVALID_OVERLAY_SETTINGS.values(),
    ids=INVALID_OVERLAY_SETTINGS.keys(),
)
def test_an_overlay_setting_that_fails_validation_is_a_config_error(
    overlay: str, literal: str, message: str, deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "k8s" / "overlays" / overlay / "kustomization.yaml",
        "    behavior: merge\n    literals:\n",
        f"    behavior: merge\n    literals:\n      - {literal}\n",
    )
    assert check(deploy_copy) == 2
    assert message in config_error(capsys)


def test_a_setting_that_fails_validation_in_this_environment_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STEADY_MAX_INFLIGHT", "0")
    assert check(DEPLOY) == 2
    err = config_error(capsys)
    assert 'this environment: STEADY_MAX_INFLIGHT="0" does not validate: Input should be' in err


@pytest.mark.parametrize("field", ["env", "envFrom"])
def test_an_empty_env_list_is_read_as_empty(
    field: str, deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`env:` with nothing under it is null in YAML and no variables to Kubernetes."""
    edit_server_container(deploy_copy, lambda container: container.update({field: None}))
    status = check(deploy_copy)
    out = capsys.readouterr().out
    if field == "envFrom":
        # Without its ConfigMap the pod runs on the defaults: drift, named.
        assert status == 1 and 'k8s[cpu].settings.device: baseline "cpu"' in out
    else:
        assert status == 0, out


def test_a_baseline_section_left_empty_is_read_as_empty(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every entry of an overlay's `settings:` commented out leaves YAML null (it raised
    TypeError): no entries, so the pod's settings differ from what it pins no more."""
    baseline = deploy_copy / "baseline.yaml"
    text = baseline.read_text()
    start = text.index("  cpu:\n    settings:\n") + len("  cpu:\n    settings:\n")
    end = text.index("\n    k8s:", start) if "\n    k8s:" in text[start:] else len(text)
    commented = "".join(f"#{line}" for line in text[start:end].splitlines(keepends=True))
    baseline.write_text(text[:start] + commented + text[end:])
    status = check(deploy_copy)
    captured = capsys.readouterr()
    assert status in (0, 1) and "Traceback" not in captured.err, captured.err


def test_a_baseline_section_of_the_wrong_kind_is_a_config_error(
    deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    replace_once(
        deploy_copy / "baseline.yaml",
        "  cpu:\n    settings:\n",
        "  cpu:\n    settings: 5\n    unused:\n",
    )
    assert check(deploy_copy) == 2
    assert "overlays.cpu.settings must be a mapping, not int" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["lots", "null", "12.5", "true", "0"])
def test_a_replica_inflight_that_is_no_count_of_requests_is_a_config_error(
    value: str, deploy_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A word or null was a ValueError or TypeError traceback; 12.5 was read as 12."""
    replace_once(
        deploy_copy / "baseline.yaml", "replica_inflight: 128", f"replica_inflight: {value}"
    )
    assert check(deploy_copy) == 2
    assert "capacity.replica_inflight must be a whole number of requests" in config_error(capsys)
