"""The README's batch-client section runs as written: its command parses with the real
CLI, every option it names exists, and its Python example works against a server."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from app.batchclient.cli import build_parser
from tests.support.flaky_server import Misbehaviour, running_flaky_server, vector_of
from tests.support.server import REPO_ROOT

pytestmark = pytest.mark.e2e

README_URL = "http://127.0.0.1:8000"


def _section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## Batch client")
    return text[start : text.index("\n## ", start + 1)]


def _block(language: str) -> str:
    match = re.search(rf"```{language}\n(.*?)```", _section(), re.S)
    assert match, f"no {language} block in the README's batch section"
    return match.group(1)


def test_the_readme_command_and_options_are_the_real_cli_s() -> None:
    words = shlex.split(_block("sh").replace("\\\n", " "))
    assert words[:2] == [".venv/bin/steadyserve", "batch"]
    build_parser().parse_args(words[2:])  # exits (SystemExit) on an unknown option
    known = {o for action in build_parser()._actions for o in action.option_strings}
    named = set(re.findall(r"`(--[a-z-]+)", _section()))
    assert named and named <= known, named - known


def test_the_readme_python_example_runs(tmp_path: Path) -> None:
    with running_flaky_server(Misbehaviour()) as server:
        code = _block("python").replace(README_URL, f"http://127.0.0.1:{server.port}")
        namespace: dict[str, object] = {"__name__": "readme_example"}
        exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["vectors"] == {
        0: vector_of("The quick brown fox"),
        1: vector_of("jumps over the lazy dog"),
    }
