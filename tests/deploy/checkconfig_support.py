"""Shared by the check-config tests: run the command on a deploy tree, edit a file in it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from app.checkconfig import main


def check(deploy: Path) -> int:
    """`steadyserve check-config` on the baseline, Envoy config and k8s tree under `deploy`."""
    return main(
        [
            "--baseline",
            str(deploy / "baseline.yaml"),
            "--envoy",
            str(deploy / "envoy" / "envoy.yaml"),
            "--k8s",
            str(deploy / "k8s"),
        ]
    )


def replace_once(path: Path, old: str, new: str) -> None:
    """Edit `path`; `old` must occur exactly once, so an edit never silently misses."""
    text = path.read_text()
    assert text.count(old) == 1, f"{old!r} in {path}"
    path.write_text(text.replace(old, new))


def edit_server_container(deploy: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Edit the server container of the base Deployment (as data; comments are lost)."""
    path = deploy / "k8s" / "base" / "steadyserve-deployment.yaml"
    deployment = yaml.safe_load(path.read_text())
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    edit(container)
    path.write_text(yaml.safe_dump(deployment))
