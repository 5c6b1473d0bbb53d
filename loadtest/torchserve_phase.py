"""What `loadtest.bench`'s torchserve phase starts: TorchServe with server-side batching
serving the bench's model through `loadtest/torchserve_handler.py`.

TorchServe is the server this project is most often measured against: a Java front end
(Netty) that queues requests per model, forms batches of up to `batchSize` within
`maxBatchDelay` ms, and hands each batch to Python workers over a local socket. The phase
gives it the bench's CPUs: by default one worker computing with all `--threads` torch threads
(as the raw phase and the naive server do; `--torchserve-workers` splits them), batches of
up to the bench's connection count.

Needs Java 17 (`tools/ensure-tools.sh --bench` installs it) and the `torchserve` and
`torch-model-archiver` packages (the bench extra: `make setup-bench`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
HANDLER = REPO_ROOT / "loadtest" / "torchserve_handler.py"
MODEL = "minilm"


@dataclass(frozen=True)
class TorchServeLayout:
    """Ports (inference, management, metrics), batching and threads of one TorchServe."""

    inference_port: int
    management_port: int
    metrics_port: int
    batch_size: int
    max_batch_delay_ms: int
    workers: int
    threads_per_worker: int
    dtype: str

    @property
    def inference_path(self) -> str:
        return f"/predictions/{MODEL}"

    @property
    def ready_url(self) -> str:
        """200 once every model has its minimum workers up ("Healthy"), 500 before."""
        return f"http://127.0.0.1:{self.inference_port}/ping"

    def config_properties(self) -> str:
        models = {
            MODEL: {
                "1.0": {
                    "marName": f"{MODEL}.mar",
                    "minWorkers": self.workers,
                    "maxWorkers": self.workers,
                    "batchSize": self.batch_size,
                    "maxBatchDelay": self.max_batch_delay_ms,
                    "responseTimeout": 120,
                }
            }
        }
        return "\n".join(
            [
                f"inference_address=http://127.0.0.1:{self.inference_port}",
                f"management_address=http://127.0.0.1:{self.management_port}",
                f"metrics_address=http://127.0.0.1:{self.metrics_port}",
                "disable_token_authorization=true",
                f"load_models={MODEL}.mar",
                f"models={json.dumps(models)}",
                "",
            ]
        )


def _tool(name: str) -> str:
    """A console script of this interpreter's environment (the bench extra installs it)."""
    path = Path(sys.executable).parent / name
    if not path.exists():
        raise RuntimeError(f"{name} is not installed: make setup-bench (pip install -e '.[bench]')")
    return str(path)


def prepare(layout: TorchServeLayout, directory: Path) -> list[str]:
    """Write the model archive and config under `directory`; the command that serves them
    in the foreground (run it with `directory` as its working folder: TorchServe writes its
    logs there). Raises RuntimeError when Java or TorchServe is missing."""
    if shutil.which("java") is None:
        raise RuntimeError("TorchServe needs Java 17: run tools/ensure-tools.sh --bench")
    store = directory / "model-store"
    store.mkdir(parents=True, exist_ok=True)
    (store / f"{MODEL}.mar").unlink(missing_ok=True)
    archive = [
        _tool("torch-model-archiver"),
        "--model-name", MODEL,
        "--version", "1.0",
        "--handler", str(HANDLER),
        "--export-path", str(store),
    ]  # fmt: skip
    archived = subprocess.run(archive, capture_output=True, text=True, check=False)
    if archived.returncode != 0:
        raise RuntimeError(f"torch-model-archiver failed: {archived.stderr.strip()}")
    config = directory / "config.properties"
    config.write_text(layout.config_properties())
    return [
        _tool("torchserve"),
        "--start",
        "--foreground",
        "--no-config-snapshots",
        "--ts-config", str(config),
        "--model-store", str(store),
    ]  # fmt: skip


def environment(layout: TorchServeLayout, base: dict[str, str]) -> dict[str, str]:
    """The environment TorchServe passes on to its Python worker: the repository on the
    path (the handler imports `loadtest.minilm`), the bench's dtype and threads."""
    python_path = [str(REPO_ROOT), *filter(None, [base.get("PYTHONPATH")])]
    return {
        **base,
        "PYTHONPATH": ":".join(python_path),
        "PATH": f"{Path(sys.executable).parent}:{base.get('PATH', '')}",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "STEADY_BENCH_THREADS": str(layout.threads_per_worker),
        "STEADY_BENCH_DTYPE": layout.dtype,
    }
