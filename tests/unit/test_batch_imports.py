"""The batch client runs on orchestrator machines: it must not load torch or the model."""

from __future__ import annotations

import subprocess
import sys

from tests.support.server import REPO_ROOT


def test_batch_command_and_api_do_not_import_torch() -> None:
    probe = (
        "import sys, app.cli, app.batchclient, app.batchclient.cli;"
        "app.batchclient.cli.build_parser();"
        "heavy = [m for m in ('torch', 'transformers', 'app.service') if m in sys.modules];"
        "print(heavy)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, check=True
    )
    assert done.stdout.strip() == "[]"


def test_steadyserve_batch_help_lists_the_options() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "app.cli", "batch", "--help"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    for option in ("--url", "--out", "--concurrency", "--rate", "--inputs-per-request",
                   "--timeout-ms", "--max-retries", "--header", "--summary-json"):  # fmt: skip
        assert option in done.stdout
