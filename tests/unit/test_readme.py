"""The README's settings table is the one `steadyserve settings` prints, and the commands it
shows are the real Makefile's and CLI's. (The paths and metrics every README names:
tests/unit/test_doc_names.py.)"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from app.cli import DELEGATED, build_parser
from app.schemas import openai_error_type
from app.settings_doc import settings_table
from tests.support.answered_errors import answered_error_types

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_lists_every_setting_as_the_code_describes_it() -> None:
    assert settings_table() in README.read_text(), "run `steadyserve settings` and paste it"


def _code() -> list[str]:
    """The README's code, where its commands are: each fenced block, then each inline span."""
    text = README.read_text()
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    return [*fenced, *(span.replace("\n", " ") for span in inline)]


def _command_lines() -> list[str]:
    """Every line of the README's code, continuation lines joined, comments dropped."""
    return [
        line.split(" #")[0].strip()
        for piece in _code()
        for line in piece.replace("\\\n", " ").splitlines()
    ]


def test_every_make_target_the_readme_shows_is_the_makefile_s() -> None:
    targets = {t for line in _command_lines() for t in re.findall(r"\bmake ([a-z][a-z-]*)", line)}
    assert {"serve", "test"} <= targets  # the two commands a fresh machine starts from
    for target in sorted(targets):
        # make itself says whether the Makefile has the target; a dry run runs nothing.
        result = subprocess.run(
            ["make", "--dry-run", target], cwd=README.parent, capture_output=True, text=True
        )
        assert result.returncode == 0, f"make {target}: {result.stderr}"


def test_every_steadyserve_command_the_readme_shows_parses_with_the_real_cli() -> None:
    commands = [
        shlex.split(line[match.end() :])
        for line in _command_lines()
        if (match := re.search(r"(^|\s)(\.venv/bin/)?steadyserve(?= )", line))
    ]
    assert any(words[:1] == ["spikes"] and len(words) > 1 for words in commands)
    for words in commands:
        arguments, rest = build_parser().parse_known_args(words)  # an unknown command exits 2
        if words[1:] and arguments.command in DELEGATED:
            # Named with arguments: a whole command, parsed as its own module parses it.
            importlib.import_module(DELEGATED[arguments.command]).parse_arguments(rest)
        elif words[1:]:
            build_parser().parse_args(words)


def test_every_steadyserve_command_with_arguments_is_the_venv_s() -> None:
    """`make serve` puts the console script in .venv/bin, not on PATH: a command to run says
    so (a bare `steadyserve serve` in prose only names the subcommand)."""
    commands = [
        line[match.start() :]
        for line in _command_lines()
        if (match := re.search(r"(?:^|\s)(\S*steadyserve) [a-z-]+ \S", line))
    ]
    assert any(" batch " in command for command in commands)
    bare = [command for command in commands if not command.lstrip().startswith(".venv/bin/")]
    assert not bare, bare


def test_each_python_example_says_how_to_get_what_make_serve_does_not_install() -> None:
    """A package a Python example imports that is no runtime dependency is named with how to
    get it (`make setup-dev`, or a pip install) in the paragraph before the example."""
    text = README.read_text()
    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
    runtime = {canonicalize_name(Requirement(line).name) for line in project["dependencies"]}
    distributions = importlib.metadata.packages_distributions()
    examples = list(re.finditer(r"```python\n(.*?)```", text, re.S))
    assert len(examples) >= 2
    needing = 0
    for example in examples:
        modules = re.findall(r"^(?:import|from) (\w+)", example.group(1), re.MULTILINE)
        extra = {
            canonicalize_name(distributions[module][0])
            for module in modules
            if module not in sys.stdlib_module_names and module != "app"
        } - runtime
        before = text[: example.start()].rstrip().rsplit("\n\n", 1)[-1]
        for name in sorted(extra):
            needing += 1
            assert "make setup-dev" in before or re.search(rf"pip install .*{name}", before), (
                f"{name}: say how to get it before the example ({before!r})"
            )
    assert needing >= 2  # tritonclient and openai


def test_the_readme_error_table_names_every_error_the_server_answers() -> None:
    rows = re.findall(r"^\| (\d{3}) \| .* \| (.*) \|$", README.read_text(), re.MULTILINE)
    table = {
        (int(status), kind) for status, kinds in rows for kind in re.findall(r"`(\w+)`", kinds)
    }
    answered = answered_error_types()
    assert len(answered) > 20  # the scan found the app's errors
    assert answered <= table, sorted(answered - table)


def test_the_readme_names_openai_s_error_type_of_every_status_answered() -> None:
    """The OpenAI routes' `type` (`schemas.openai_error_type`) of each status the app answers."""
    text = README.read_text()
    types = {openai_error_type(status) for status, _ in answered_error_types()}
    assert len(types) == 3
    assert all(f"`{kind}`" in text for kind in types), types
