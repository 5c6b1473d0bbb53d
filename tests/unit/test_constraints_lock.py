"""constraints-lock.txt pins every package the installs bring in but torch, so an upstream
release cannot change what `make test` installs; torch and what only torch needs stay with
$(TORCH_CONSTRAINTS) (a CUDA build brings its own requirements). Each line must install on a
fresh machine: a plain `name==version`, no local path or URL."""

from __future__ import annotations

import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.support.server import REPO_ROOT

LOCK = REPO_ROOT / "constraints-lock.txt"
# torch, and what only torch requires: pinned here, they would fight a CUDA build's own pins.
TORCH_ONLY = {"torch", "sympy", "mpmath", "networkx", "setuptools"}


def pins() -> dict[str, str]:
    lines = [line.strip() for line in LOCK.read_text().splitlines()]
    entries = [line for line in lines if line and not line.startswith("#")]
    bad = [line for line in entries if not re.fullmatch(r"[A-Za-z0-9][\w.-]*==[\w.!+]+", line)]
    assert not bad, f"not a plain name==version (a local path or URL?): {bad}"
    names = [canonicalize_name(line.split("==")[0]) for line in entries]
    assert len(names) == len(set(names)), "a package pinned twice"
    return dict(zip(names, (line.split("==")[1] for line in entries), strict=True))


def test_the_lock_leaves_torch_to_the_torch_constraints() -> None:
    assert not TORCH_ONLY & set(pins())
    assert not any("+" in version for version in pins().values()), "a local build"


def test_every_requirement_of_the_project_is_pinned() -> None:
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"]]
    for extra in project["optional-dependencies"].values():
        requirements += extra
    names = {canonicalize_name(Requirement(line).name) for line in requirements}
    names -= {"steadyserve"} | TORCH_ONLY
    assert names - set(pins()) == set()
    # What the reviewer found drifting: stubs mypy --strict reads, uvicorn's private method
    # that app/api/shedding_protocol.py overrides, output the tests compare.
    for name in ("fastapi", "starlette", "pydantic", "numpy", "uvicorn", "schemathesis"):
        assert name in pins(), name
