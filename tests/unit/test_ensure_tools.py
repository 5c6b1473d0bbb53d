"""tools/ensure-tools.sh, the step of `make test` that provides the system tools the tests
drive: silent when they are all there, and naming each missing tool and its package where
it cannot install them (here: a PATH without apt-get)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

from tests.support.server import REPO_ROOT

SCRIPT = REPO_ROOT / "tools" / "ensure-tools.sh"


def listed_tools() -> dict[str, str]:
    """The script's own (command, Debian package) list, read from the script."""
    body = SCRIPT.read_text().split("TOOLS=(", 1)[1].split(")", 1)[0]
    return dict(re.findall(r'^\s*"(\S+) (\S+)"', body, flags=re.MULTILINE))


def run_with_path(path: Path) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash")
    assert bash is not None
    return subprocess.run(
        [bash, str(SCRIPT)],
        env={"PATH": str(path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_every_listed_tool_is_one_a_test_drives() -> None:
    tests_text = "\n".join(p.read_text() for p in (REPO_ROOT / "tests").rglob("*.py"))
    tools = listed_tools()
    assert {"promtool", "hey"} <= set(tools)
    for tool in tools:
        assert re.search(rf'require_tool\("{tool}"\)|which\("{tool}"\)', tests_text), tool


def test_nothing_happens_when_every_tool_is_present(tmp_path: Path) -> None:
    for tool in listed_tools():
        fake = tmp_path / tool
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
    result = run_with_path(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == result.stderr == ""


def test_a_missing_tool_without_apt_is_named_with_its_package(tmp_path: Path) -> None:
    tools = listed_tools()
    present, *absent = tools
    fake = tmp_path / present
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    result = run_with_path(tmp_path)  # no apt-get on this PATH
    assert result.returncode == 1
    for tool in absent:
        assert f"{tool} (Debian package {tools[tool]})" in result.stderr
    assert f"{present} (" not in result.stderr


def listed_bench_tools() -> dict[str, str]:
    """The tools only `make bench` asks for (`--bench`), read from the script."""
    body = SCRIPT.read_text().split("BENCH_TOOLS=(", 1)[1].split(")", 1)[0]
    return dict(re.findall(r'^\s*"(\S+) (\S+)"', body, flags=re.MULTILINE))


def test_bench_tools_are_asked_for_only_with_bench(tmp_path: Path) -> None:
    for tool in listed_tools():
        fake = tmp_path / tool
        fake.write_text("#!/bin/sh\n")
        fake.chmod(0o755)
    assert run_with_path(tmp_path).returncode == 0  # `make test` needs no bench tool
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run(
        [bash, str(SCRIPT), "--bench"],
        env={"PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 1
    bench_tools = listed_bench_tools()
    assert bench_tools
    for tool, package in bench_tools.items():
        assert f"{tool} (Debian package {package})" in result.stderr


def test_every_bench_tool_is_one_a_bench_drives() -> None:
    loadtest_text = "\n".join(p.read_text() for p in (REPO_ROOT / "loadtest").rglob("*.py"))
    for tool in listed_bench_tools():
        assert re.search(rf'which\("{tool}"\)', loadtest_text), tool
