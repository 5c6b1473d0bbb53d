"""uvicorn's own lines come out in the project's format (time, level, process role and pid),
at the level `STEADY_LOG_LEVEL` sets, less the warnings any client can cause: a front end
configures uvicorn without uvicorn's logging configuration (`cli.uvicorn_config`), whose
handlers printed "INFO:     Started server process [7]", no time, no role, no pid. Run in a
child: logging's configuration is the process's."""

from __future__ import annotations

import re
import subprocess
import sys

FRONT_END = """
import logging
from fastapi import FastAPI
from app.cli import uvicorn_config
from app.frontend_process import configure_logging
from app.metrics import Metrics
from app.settings import Settings

configure_logging("info", "frontend[7]")
app = FastAPI()
app.state.service = type("Service", (), {"metrics": Metrics()})()
app.state.shed_paths = {}
uvicorn = logging.getLogger("uvicorn.error")
for level in ("info", "error"):
    assert uvicorn_config(app, Settings(log_level=level)).log_config is None
    uvicorn.info("Started server process [7] at %s", level)
    uvicorn.warning("Invalid HTTP request received.")  # any client's doing: dropped
    uvicorn.error("Exception in ASGI application at %s", level)
"""

STAMP = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} "


def test_uvicorn_lines_take_the_front_end_s_format_and_level() -> None:
    child = subprocess.run(
        [sys.executable, "-c", FRONT_END], capture_output=True, text=True, timeout=60
    )
    assert child.returncode == 0, child.stderr
    lines = [line for line in child.stderr.splitlines() if "uvicorn.error" in line]
    expected = [
        r"INFO frontend\[7\] uvicorn\.error: Started server process \[7\] at info",
        r"ERROR frontend\[7\] uvicorn\.error: Exception in ASGI application at info",
        # STEADY_LOG_LEVEL=error: uvicorn's info line is left out
        r"ERROR frontend\[7\] uvicorn\.error: Exception in ASGI application at error",
    ]
    assert len(lines) == len(expected), child.stderr
    for line, pattern in zip(lines, expected, strict=True):
        assert re.fullmatch(STAMP + pattern, line), line
