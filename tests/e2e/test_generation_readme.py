"""The README's text-generation section runs as written against a real `steadyserve serve`
serving the tiny causal LM: its STEADY_MODELS declaration is a valid setting, every curl
command answers (the streamed one ending in `data: [DONE]`), and its openai-client example
runs unchanged."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.settings import Settings
from tests.deploy.tools import require_tool
from tests.support.server import REPO_ROOT, ServerProcess, running_server

pytestmark = pytest.mark.e2e

README_ADDRESS = "localhost:8000"
README_URL = "http://127.0.0.1:8000"
MODEL_PLACEHOLDER = "/path/to/model"


def _section() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    start = text.index("## Text generation")
    return text[start : text.index("\n## ", start + 1)]


def _block(language: str) -> str:
    match = re.search(rf"```{language}\n(.*?)```", _section(), re.S)
    assert match, f"no {language} block in the README's generation section"
    return match.group(1)


def _commands() -> list[list[str]]:
    lines = _block("sh").replace("\\\n", " ").splitlines()
    return [shlex.split(line) for line in lines if line.strip() and not line.startswith("#")]


def _models_setting(model: Path) -> str:
    first = _commands()[0]
    assert first[0].startswith("STEADY_MODELS=") and first[1:] == ["make", "serve"], first
    declared = first[0].removeprefix("STEADY_MODELS=")
    assert MODEL_PLACEHOLDER in declared
    return declared.replace(MODEL_PLACEHOLDER, str(model))


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_causal_lm: Path
) -> Iterator[ServerProcess]:
    env = {"STEADY_MODELS": _models_setting(tiny_causal_lm), "STEADY_FRONTEND_WORKERS": "1"}
    with running_server(tmp_path_factory.mktemp("generation-readme"), env) as process:
        yield process


def test_the_readme_models_setting_declares_a_generate_model(tiny_causal_lm: Path) -> None:
    models = json.loads(_models_setting(tiny_causal_lm))
    settings = Settings(models=models)
    assert [(m.name, m.task) for m in settings.models] == [("tiny", "generate")]


def test_every_readme_curl_command_answers(server: ServerProcess) -> None:
    curls = [command for command in _commands() if command[0] == "curl"]
    assert len(curls) == 3
    curl = require_tool("curl")  # the README's own client, as a reader would run it
    for command in curls:
        command = [word.replace(README_ADDRESS, f"127.0.0.1:{server.port}") for word in command]
        command[0] = curl
        result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
        if "-sN" in command:  # the streamed chat
            assert result.stdout.startswith("data: {"), result.stdout[:200]
            assert result.stdout.endswith("data: [DONE]\n\n"), result.stdout[-200:]
            continue
        body = json.loads(result.stdout)
        assert "error" not in body, body
        choices = body.get("outputs") or body.get("choices")
        assert choices and choices[0]["finish_reason"] in {"stop", "length"}, body


def test_the_readme_openai_example_runs(server: ServerProcess) -> None:
    code = _block("python").replace(README_URL, server.base_url)
    namespace: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, "README.md", "exec"), namespace)
    completion = namespace["completion"]
    assert completion.choices[0].finish_reason in {"stop", "length"}  # type: ignore[attr-defined]
    assert isinstance(namespace["reply"], str)
