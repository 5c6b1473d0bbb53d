"""loadtest/gpu_check.sh fails clearly, with a verdict, where there is no usable GPU (here:
an `nvidia-smi` that fails, on any machine), instead of running on and exiting 0; and it
runs .venv/bin/python only where that imports a torch that sees CUDA, else python3 (fake
interpreters here), saying which and its torch version."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.server import REPO_ROOT


def test_without_a_working_gpu_the_check_fails_at_its_first_step(tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    broken = fake_bin / "nvidia-smi"
    broken.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no devices' >&2\nexit 9\n")
    broken.chmod(0o755)
    out = tmp_path / "out"
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "loadtest" / "gpu_check.sh"), str(out)],
        env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    verdicts = (out / "verdicts.txt").read_text()
    assert verdicts.splitlines()[0] == "FAIL gpu: nvidia-smi failed (see env.txt)"
    assert "FAILED at step 'gpu'" in verdicts
    assert "NVIDIA-SMI has failed" in (out / "env.txt").read_text()
    assert not (out / "pytest.txt").exists()  # stopped there: nothing ran after the failure


def _fake_python(path: Path, version: str, sees_cuda: bool) -> None:
    """An interpreter that answers the script's two torch questions: does it see CUDA (a
    `torch.cuda.is_available()` exit code), and its torch version."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "#!/bin/sh\n"
        'case "$2" in\n'
        f"  *is_available*) exit {0 if sees_cuda else 1} ;;\n"
        f"  *__version__*) echo {version} ;;\n"
        "  *) exit 3 ;;\n"
        "esac\n"
    )
    path.chmod(0o755)


def _run_in_fake_repo(tmp_path: Path, venv_sees_cuda: bool, **env: str) -> str:
    """gpu_check.sh run from a copy of the repository whose .venv python has a CPU torch
    (or a CUDA one), python3 on PATH a CUDA torch; stopped at step 1 by a failing
    nvidia-smi. Its stdout."""
    repo = tmp_path / "repo"
    (repo / "loadtest").mkdir(parents=True)
    script = repo / "loadtest" / "gpu_check.sh"
    script.write_text((REPO_ROOT / "loadtest" / "gpu_check.sh").read_text())
    venv_torch = "2.13.0+cu130" if venv_sees_cuda else "2.13.0+cpu"
    _fake_python(repo / ".venv" / "bin" / "python", venv_torch, venv_sees_cuda)
    fake_bin = tmp_path / "bin"
    _fake_python(fake_bin / "python3", "2.11.0+cu130", True)
    (fake_bin / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")
    (fake_bin / "nvidia-smi").chmod(0o755)
    result = subprocess.run(
        ["bash", str(script), str(tmp_path / "out")],
        env={**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}", **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 1, result.stdout + result.stderr
    return result.stdout


def test_a_venv_whose_torch_cannot_see_cuda_is_passed_over_for_python3(tmp_path: Path) -> None:
    """On a GPU box `make setup-dev` can leave a .venv without CUDA torch (offline, its
    install failed, or the CPU pin): the check ran it anyway and failed step 1 with a
    misleading message. It now says so and runs python3."""
    out = _run_in_fake_repo(tmp_path, venv_sees_cuda=False, PYTHON="")
    fake_python3 = tmp_path / "bin" / "python3"
    assert ".venv/bin/python has no torch that sees CUDA; using python3" in out
    assert f"gpu_check: python python3 ({fake_python3}), torch 2.11.0+cu130" in out
    assert "torch 2.11.0+cu130" in (tmp_path / "out" / "env.txt").read_text()


def test_a_venv_whose_torch_sees_cuda_is_used(tmp_path: Path) -> None:
    out = _run_in_fake_repo(tmp_path, venv_sees_cuda=True, PYTHON="")
    assert "gpu_check: python .venv/bin/python (.venv/bin/python), torch 2.13.0+cu130" in out


def test_python_from_the_environment_is_used_as_it_is(tmp_path: Path) -> None:
    fake_python3 = tmp_path / "bin" / "python3"
    out = _run_in_fake_repo(tmp_path, venv_sees_cuda=True, PYTHON=str(fake_python3))
    assert f"gpu_check: python {fake_python3} ({fake_python3}), torch 2.11.0+cu130" in out
