"""tools/ensure-tools.sh, the step of `make test` that provides the system tools the tests
drive: silent when they are all there, and naming each missing tool and its package where
it cannot install them (here: a PATH without apt-get)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


def _installing_run(
    tmp_path: Path, policy: Path, apt_status: int = 0
) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    """The script run as root with every listed tool present but one, and a fake apt-get
    that records its arguments and what policy-rc.d answers during the install, then
    provides the missing tool (or fails with `apt_status`)."""
    if os.geteuid() != 0:
        pytest.skip("the script installs only as root (CI and the project's machines are)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for command in ("rm", "chmod", "cat"):  # what the script runs beside the tools
        found = shutil.which(command)
        assert found is not None
        (bin_dir / command).symlink_to(found)
    tools = listed_tools()
    missing = "hey"
    for tool in tools:
        if tool != missing:
            (bin_dir / tool).write_text("#!/bin/sh\n")
            (bin_dir / tool).chmod(0o755)
    log = tmp_path / "apt.log"
    (bin_dir / "apt-get").write_text(
        "#!/bin/sh\n"
        f'echo "args: $*" >> {log}\n'
        'case " $* " in *" install "*)\n'
        f'  if [ -x {policy} ]; then {policy} x start; echo "policy: $?" >> {log}; '
        f'else echo "policy: none" >> {log}; fi\n'
        f"  [ {apt_status} -eq 0 ] || exit {apt_status}\n"
        f'  printf "#!/bin/sh\\n" > {bin_dir / missing}; /bin/chmod 755 {bin_dir / missing};;\n'
        "esac\n"
    )
    (bin_dir / "apt-get").chmod(0o755)
    bash = shutil.which("bash")
    assert bash is not None
    result = subprocess.run(
        [bash, str(SCRIPT)],
        env={"PATH": str(bin_dir), "ENSURE_TOOLS_POLICY_RC_D": str(policy)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    return result, log.read_text().splitlines() if log.exists() else []


def test_no_service_starts_during_the_install_and_the_policy_is_removed_after(
    tmp_path: Path,
) -> None:
    """`prometheus` (for promtool) would start a server on :9090: a policy-rc.d that exits
    101 forbids it while apt installs, and is gone afterwards."""
    policy = tmp_path / "policy-rc.d"
    result, log = _installing_run(tmp_path, policy)
    assert result.returncode == 0, result.stderr
    assert "policy: 101" in log, log
    assert not policy.exists() and not policy.is_symlink()
    apt_calls = [line for line in log if line.startswith("args: ")]
    assert len(apt_calls) == 2 and all("-o DPkg::Lock::Timeout=300" in c for c in apt_calls)


def test_the_policy_is_removed_when_the_install_fails(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    result, log = _installing_run(tmp_path, policy, apt_status=100)
    assert result.returncode != 0
    assert "policy: 101" in log, log
    assert not policy.exists()


def test_a_policy_that_was_there_is_left_as_it_was(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    mine = "#!/bin/sh\nexit 104\n"
    policy.write_text(mine)
    policy.chmod(0o755)
    result, log = _installing_run(tmp_path, policy)
    assert result.returncode == 0, result.stderr
    assert "policy: 104" in log, log
    assert policy.read_text() == mine
