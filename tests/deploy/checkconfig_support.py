"""Shared by the check-config tests: run the command on a deploy tree, edit a file in it."""

from __future__ import annotations

from pathlib import Path

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
