"""The shipped Envoy on 127.0.0.1 for tests: `loadtest/local_envoy.py` (the config with
only addresses changed, a running Envoy, its stats), plus a stub replica and a POST helper.
"""

from __future__ import annotations

import http.client
from http.server import BaseHTTPRequestHandler

from loadtest.local_envoy import (
    ENVOY_YAML,
    UPSTREAM_CLUSTER,
    EnvoyProcess,
    envoy_binary,
    free_ports,
    http_get,
    local_envoy_config,
    running_envoy,
    upstream_cluster,
    wait_for,
)

__all__ = [
    "ENVOY_YAML",
    "UPSTREAM_CLUSTER",
    "EnvoyProcess",
    "HealthyReplica",
    "envoy_binary",
    "free_ports",
    "http_get",
    "local_envoy_config",
    "post_json",
    "running_envoy",
    "upstream_cluster",
    "wait_for",
]


def post_json(
    connection: http.client.HTTPConnection, path: str, body: bytes, timeout_s: float = 30.0
) -> tuple[int, dict[str, str], bytes]:
    """One POST on a kept-alive connection: (status, lower-cased headers, body)."""
    connection.timeout = timeout_s
    connection.request("POST", path, body=body, headers={"content-type": "application/json"})
    response = connection.getresponse()
    payload = response.read()
    headers = {name.lower(): value for name, value in response.getheaders()}
    return response.status, headers, payload


class HealthyReplica(BaseHTTPRequestHandler):
    """A stub replica for a real Envoy: its health check (GET) passes; a subclass answers
    the POSTs. Quiet."""

    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the tests read what Envoy did."""
