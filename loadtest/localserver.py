"""What a bench needs to start a server on this machine and reach it: `REPO_ROOT` (the
working directory servers start in, and where results go by default), a `free_port` to give
it, and `http_status` / `get_json`, plain blocking GETs for readiness polls and the
server's JSON answers. Any thread may call these.
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def http_status(url: str) -> int | None:
    """The status of a GET of `url` (2 s timeout), None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as response:
            return int(response.status)
    except urllib.error.HTTPError as error:
        return int(error.code)
    except (urllib.error.URLError, OSError):
        return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the server binds it after)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def get_json(url: str, timeout: float = 5.0) -> tuple[int | None, dict[str, Any]]:
    """The status and JSON body of a GET of `url`: (None, {}) when nothing answered or a 2xx
    body is not JSON; an error status whose body is not JSON raises ValueError."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), json.loads(response.read() or b"{}")
    except urllib.error.HTTPError as error:
        return int(error.code), json.loads(error.read() or b"{}")
    except (urllib.error.URLError, OSError, ValueError):
        return None, {}
