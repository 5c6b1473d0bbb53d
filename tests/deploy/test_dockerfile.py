"""Dockerfile: hadolint-clean and shaped as deploy/README.md says (no Docker engine runs in CI,
so the image is linted and inspected, not built)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

from app.cli import build_parser
from tests.deploy.tools import DEPLOY, require_tool, run_tool
from tests.support.server import REPO_ROOT

DOCKERFILE = REPO_ROOT / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    pairs = []
    for line in joined.splitlines():
        stripped = line.strip()
        if stripped and not stripped.startswith("#"):
            keyword, _, rest = stripped.partition(" ")
            pairs.append((keyword.upper(), rest.strip()))
    return pairs


def test_hadolint_passes() -> None:
    result = run_tool(require_tool("hadolint"), str(DOCKERFILE))
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_flags_a_root_user_and_unpinned_packages(tmp_path: Path) -> None:
    """The check above can fail."""
    broken = DOCKERFILE.read_text().replace("USER 10001:10001", "USER root")
    broken += "RUN pip install --no-cache-dir requests\n"
    path = tmp_path / "Dockerfile"
    path.write_text(broken)
    result = run_tool(require_tool("hadolint"), str(path))
    assert result.returncode != 0
    assert "DL3002" in result.stdout and "DL3013" in result.stdout


def test_multi_stage_non_root_with_healthcheck_and_entry_point() -> None:
    steps = instructions(DOCKERFILE.read_text())
    stages = [args for keyword, args in steps if keyword == "FROM"]
    assert len(stages) >= 2
    assert any(" AS runtime" in stage for stage in stages)
    final_stage = steps[max(i for i, (keyword, _) in enumerate(steps) if keyword == "FROM") :]
    users = [args for keyword, args in final_stage if keyword == "USER"]
    assert users and not users[-1].startswith(("root", "0"))
    healthchecks = [args for keyword, args in final_stage if keyword == "HEALTHCHECK"]
    # On the probe port Kubernetes uses, which carries no traffic; its path is one that port
    # serves (test_served_paths.py, against app/probes.py's routes).
    assert len(healthchecks) == 1 and "STEADY_HEALTH_PORT" in healthchecks[0]
    envs = " ".join(args for keyword, args in final_stage if keyword == "ENV")
    kustomization = (DEPLOY / "k8s" / "base" / "kustomization.yaml").read_text()
    port = envs.split("STEADY_HEALTH_PORT=")[1].split()[0]
    assert f"STEADY_HEALTH_PORT={port}" in kustomization
    # The entry point is the console script the package installs, and its command line
    # parses with the real CLI, as does the one the Kubernetes Deployment gives.
    entry_point = json.loads(next(args for k, args in final_stage if k == "ENTRYPOINT"))
    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry_point == ["steadyserve"] and scripts["steadyserve"] == "app.cli:main"
    command = json.loads([args for k, args in final_stage if k == "CMD"][-1])
    deployment = yaml.safe_load(
        (DEPLOY / "k8s" / "base" / "steadyserve-deployment.yaml").read_text()
    )
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    for arguments in (command, container["args"]):
        assert build_parser().parse_args(arguments).command == "serve"
    arguments = {args.split("=")[0] for keyword, args in steps if keyword == "ARG"}
    assert {"TORCH_VARIANT", "TORCH_INDEX_URL"} <= arguments


def test_image_user_is_the_one_kubernetes_runs_as() -> None:
    user = [args for keyword, args in instructions(DOCKERFILE.read_text()) if keyword == "USER"][-1]
    deployment = yaml.safe_load(
        (DEPLOY / "k8s" / "base" / "steadyserve-deployment.yaml").read_text()
    )
    pod_security = deployment["spec"]["template"]["spec"]["securityContext"]
    assert user == f"{pod_security['runAsUser']}:{pod_security['runAsGroup']}"


def _package_install() -> str:
    """The build stage's RUN that installs steadyserve (`pip install ... .`)."""
    runs = [args for keyword, args in instructions(DOCKERFILE.read_text()) if keyword == "RUN"]
    (run,) = [args for args in runs if re.search(r"pip install [^&]* \.(\s|$)", args)]
    return run


def test_the_package_install_keeps_the_torch_installed_before_it() -> None:
    """Constrained to the torch the Dockerfile installed, so a dependency that raises its
    torch floor fails the build instead of swapping in another build (PyPI's CUDA one), and
    to constraints-lock.txt, which .dockerignore lets into the build context."""
    steps = instructions(DOCKERFILE.read_text())
    pinned = "torch==${TORCH_VERSION}+${TORCH_VARIANT}"
    assert any(k == "RUN" and f'"{pinned}"' in args for k, args in steps if "index-url" in args)
    run = _package_install()
    constraints = re.search(rf'echo "{re.escape(pinned)}" > (\S+)', run)
    assert constraints, run
    install = next(part for part in run.split("&&") if "pip install" in part)
    assert f"-c {constraints[1]}" in install and "-c constraints-lock.txt" in install
    copied = " ".join(args for keyword, args in steps if keyword == "COPY")
    assert "constraints-lock.txt" in copied
    ignore = (REPO_ROOT / ".dockerignore").read_text().splitlines()
    assert "!constraints-lock.txt" in ignore and (REPO_ROOT / "constraints-lock.txt").exists()


def test_the_build_fails_when_the_installed_torch_is_another(tmp_path: Path) -> None:
    """The check after the install, run as the build runs it, with a stand-in torch."""
    (check,) = [
        part.strip()
        for part in _package_install().split("&&")
        if part.strip().startswith("python -c") and "torch" in part
    ]
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    environment = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "PYTHONPATH": f"{tmp_path}:{REPO_ROOT}",
        "TORCH_VERSION": "2.13.0",
        "TORCH_VARIANT": "cpu",
    }
    answers = {}
    for version in ("2.13.0+cpu", "2.13.0+cu128", "2.14.0"):
        (tmp_path / "torch.py").write_text(f"__version__ = {version!r}\n")
        answers[version] = subprocess.run(
            ["bash", "-c", check], env=environment, capture_output=True, text=True, check=False
        )
    assert answers["2.13.0+cpu"].returncode == 0, answers["2.13.0+cpu"].stderr
    for version in ("2.13.0+cu128", "2.14.0"):
        assert answers[version].returncode != 0, version
        assert f"torch {version} is installed, not 2.13.0+cpu" in answers[version].stderr
