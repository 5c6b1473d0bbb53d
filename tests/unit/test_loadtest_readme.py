"""loadtest/README.md's commands run as written after `make setup-dev`: the venv's console
scripts are not on PATH, so locust is `.venv/bin/locust`; and it says where its system tools
come from (tools/ensure-tools.sh, which `make test` and `make bench` run; .ci/run only runs
`make test`)."""

from __future__ import annotations

import re

from tests.support.server import REPO_ROOT

README = REPO_ROOT / "loadtest" / "README.md"


def _code() -> list[str]:
    text = README.read_text()
    fenced = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    inline = re.findall(r"`([^`]+)`", re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S))
    return [*fenced, *inline]


def test_locust_is_run_from_the_venv() -> None:
    lines = [line for piece in _code() for line in piece.replace("\\\n", " ").splitlines()]
    commands = [line for line in lines if re.search(r"(^|\s)\S*locust -f ", line)]
    assert len(commands) >= 2
    for command in commands:
        assert re.search(r"(^|\s)\.venv/bin/locust -f ", command), command


def test_hey_comes_from_ensure_tools() -> None:
    text = README.read_text()
    section = text[text.index("## hey") :].split("\n## ", 1)[0]
    assert "tools/ensure-tools.sh" in section
    assert '"hey hey"' in (REPO_ROOT / "tools" / "ensure-tools.sh").read_text()
    assert not re.search(r"\.ci/run`? installs", text)
