"""`make setup` reinstalls when `TORCH_CONSTRAINTS` names another file, whatever its age: the
venv must hold the torch build the constraints ask for (the CPU one, or a user's CUDA one).
Every install also takes constraints-lock.txt, which pins every other package, and a changed
lock reinstalls. Driven through the real Makefile against a fake venv whose `pip` only
records its calls."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _fake_venv(root: Path, log: Path) -> Path:
    venv = root / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")  # present: the venv is not created again
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    pip.chmod(pip.stat().st_mode | stat.S_IEXEC)
    return venv


def _setup(venv: Path, constraints: Path, *more: str, target: str = "setup") -> None:
    variables = [f"VENV={venv}", f"TORCH_CONSTRAINTS={constraints}", *more]
    subprocess.run(
        ["make", "-s", "-C", str(REPO), target, *variables],
        check=True,
        capture_output=True,
    )


def _installs(log: Path) -> list[str]:
    lines = log.read_text().splitlines() if log.exists() else []
    return [line for line in lines if line.startswith("install -q -c")]


def test_switching_the_constraints_file_reinstalls_even_when_it_is_older(tmp_path: Path) -> None:
    log = tmp_path / "pip.log"
    venv = _fake_venv(tmp_path, log)
    cpu, cuda = tmp_path / "cpu.txt", tmp_path / "cuda.txt"
    cpu.write_text("torch==2.13.0\n")
    cuda.write_text("torch==2.13.0+cu128\n")
    old = (REPO / "pyproject.toml").stat().st_mtime - 3600
    for path in (cpu, cuda):  # both older than any stamp make writes
        os.utime(path, (old, old))

    _setup(venv, cpu)
    assert [f"-c {cpu}" in line for line in _installs(log)] == [True]
    _setup(venv, cpu)
    assert len(_installs(log)) == 1, "same constraints: nothing to install again"

    _setup(venv, cuda)
    assert len(_installs(log)) == 2 and f"-c {cuda}" in _installs(log)[-1]
    _setup(venv, cpu)  # and back: its stamp alone would say the CPU install is current
    assert len(_installs(log)) == 3 and f"-c {cpu}" in _installs(log)[-1]


def test_every_install_takes_the_lock_beside_the_torch_constraints(tmp_path: Path) -> None:
    log = tmp_path / "pip.log"
    venv = _fake_venv(tmp_path, log)
    cpu = tmp_path / "cpu.txt"
    cpu.write_text("torch==2.13.0\n")
    _setup(venv, cpu, target="setup-dev")
    calls = log.read_text().splitlines()
    assert len(calls) == 3  # pip itself, the runtime, the dev extra
    lock = "-c constraints-lock.txt"
    assert all(call.startswith("install ") and lock in call for call in calls), calls
    assert all(f"-c {cpu}" in call for call in calls if "-e " in call), calls


def test_a_changed_lock_reinstalls(tmp_path: Path) -> None:
    log = tmp_path / "pip.log"
    venv = _fake_venv(tmp_path, log)
    cpu, lock = tmp_path / "cpu.txt", tmp_path / "lock.txt"
    cpu.write_text("torch==2.13.0\n")
    lock.write_text("numpy==2.4.6\n")
    old = (REPO / "pyproject.toml").stat().st_mtime - 3600
    for path in (cpu, lock):
        os.utime(path, (old, old))
    _setup(venv, cpu, f"LOCK_CONSTRAINTS={lock}", target="setup-dev")
    assert len(log.read_text().splitlines()) == 3
    _setup(venv, cpu, f"LOCK_CONSTRAINTS={lock}", target="setup-dev")
    assert len(log.read_text().splitlines()) == 3, "same lock: nothing to install again"

    lock.write_text("numpy==2.4.7\n")  # newer than every stamp
    _setup(venv, cpu, f"LOCK_CONSTRAINTS={lock}", target="setup-dev")
    again = log.read_text().splitlines()[3:]
    assert len(again) == 3 and all(f"-c {lock}" in call for call in again), again
