"""The benches' baselines (TorchServe and its model archiver, `transformers serve`) are in the
`bench` extra, which `make bench` installs and `make test` does not: no test runs them, and
the loadtest modules the tests import do not import them."""

from __future__ import annotations

import ast
import re
import stat
import subprocess
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.server import REPO_ROOT

BASELINES = {"torchserve", "torch-model-archiver"}
# The modules those packages (and what only they pull in, such as accelerate) install.
BASELINE_MODULES = {"ts", "model_archiver", "accelerate"}


def _extra(name: str) -> list[Requirement]:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    return [Requirement(line) for line in project["optional-dependencies"][name]]


def test_the_baselines_are_in_the_bench_extra_not_the_dev_one() -> None:
    dev = _extra("dev")
    assert not BASELINES & {canonicalize_name(r.name) for r in dev}
    assert not any(r.name == "transformers" and "serving" in r.extras for r in dev)
    bench = _extra("bench")
    assert {canonicalize_name(r.name) for r in bench} >= BASELINES
    assert any(r.name == "transformers" and "serving" in r.extras for r in bench)
    assert any(r.name == "steadyserve" and "dev" in r.extras for r in bench)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names |= {f"{node.module}.{alias.name}" for alias in node.names}
    return names


def test_no_test_imports_a_baseline() -> None:
    """Each test file's imports (anywhere), and the module-level imports of every loadtest
    module they reach: none is a baseline's."""
    seen: set[str] = set()
    pending: list[str] = []
    for path in (REPO_ROOT / "tests").rglob("*.py"):
        names = _imports(path, top_level_only=False)
        assert not {name.split(".")[0] for name in names} & BASELINE_MODULES, path
        pending += [name for name in names if name.startswith("loadtest.")]
    while pending:
        module = pending.pop()
        path = REPO_ROOT / (module.replace(".", "/") + ".py")
        if module in seen or not path.exists():  # `loadtest.x.name`: a name, not a module
            continue
        seen.add(module)
        names = _imports(path, top_level_only=True)
        assert not {name.split(".")[0] for name in names} & BASELINE_MODULES, module
        pending += [name for name in names if name.startswith("loadtest.")]
    assert "loadtest.torchserve_phase" in seen and "loadtest.generation_bench" in seen


def test_no_test_runs_a_baseline_s_command() -> None:
    command = re.compile(r"""["'](torchserve|torch-model-archiver)["']|transformers serve\b""")
    for path in (REPO_ROOT / "tests").rglob("*.py"):
        if path.name == Path(__file__).name:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                call = ast.unparse(node)
                if "subprocess" in call or "Popen" in call or "run_tool" in call:
                    assert not command.search(call), f"{path}: {call}"


def test_make_bench_installs_the_bench_extra_once(tmp_path: Path) -> None:
    log = tmp_path / "pip.log"
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("")
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    pip.chmod(pip.stat().st_mode | stat.S_IEXEC)

    def setup_bench() -> list[str]:
        subprocess.run(
            ["make", "-s", "-C", str(REPO_ROOT), "setup-bench", f"VENV={venv}"],
            check=True,
            capture_output=True,
        )
        return log.read_text().splitlines()

    calls = setup_bench()
    assert any(call.endswith("-e .[bench]") for call in calls), calls
    assert not any("[bench]" in call for call in _test_installs(venv)), "make test installs it"
    assert setup_bench() == calls, "installed again with nothing changed"
    # `make bench` itself sets up the bench extra first (a dry run runs nothing).
    dry = subprocess.run(
        ["make", "-C", str(REPO_ROOT), "--dry-run", "--always-make", "bench", f"VENV={venv}"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "-e '.[bench]'" in dry.stdout


def _test_installs(venv: Path) -> list[str]:
    """What `make test` would install in `venv` (a dry run, every stamp taken as stale)."""
    dry = subprocess.run(
        ["make", "-C", str(REPO_ROOT), "--dry-run", "--always-make", "test", f"VENV={venv}"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in dry.stdout.splitlines() if "pip install" in line]
