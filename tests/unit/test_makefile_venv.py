"""`make setup` creates the venv, and a failed creation leaves no venv behind: `python -m
venv` writes bin/python before ensurepip runs, and a half-made venv with that file would
make the next run skip creating it. Driven through the real Makefile with a fake Python."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _fake_python(path: Path, status: int) -> Path:
    """A `python -m venv DIR` that writes DIR/bin/python (and a pip that does nothing) first,
    as venv does before ensurepip, then exits with `status`."""
    path.write_text(
        "#!/bin/sh\n"
        'mkdir -p "$3/bin" && : > "$3/bin/python"\n'
        'printf "#!/bin/sh\\n" > "$3/bin/pip" && chmod +x "$3/bin/pip"\n'
        f"exit {status}\n"
    )
    path.chmod(0o755)
    return path


def _setup(venv: Path, python: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "-s", "-C", str(REPO), "setup", f"VENV={venv}", f"PYTHON={python}"],
        capture_output=True,
        text=True,
        check=False,
    )


def test_a_failed_venv_creation_removes_the_venv_and_the_next_run_creates_it(
    tmp_path: Path,
) -> None:
    venv = tmp_path / "venv"
    failing = _fake_python(tmp_path / "failing-python", 1)
    assert _setup(venv, failing).returncode != 0
    assert not venv.exists(), "a half-made venv was left: the next run would skip creating it"

    working = _fake_python(tmp_path / "python", 0)
    result = _setup(venv, working)
    assert result.returncode == 0, result.stderr
    assert (venv / "bin" / "python").exists() and (venv / ".runtime-installed").exists()
