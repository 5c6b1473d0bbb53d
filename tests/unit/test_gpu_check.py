"""loadtest/gpu_check.sh fails clearly, with a verdict, where there is no usable GPU (here:
an `nvidia-smi` that fails, on any machine), instead of running on and exiting 0."""

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
