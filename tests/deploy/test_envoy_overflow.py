"""Envoy's own 429 for the overflow of its circuit breakers, run in a real Envoy with the
shipped config (its breakers shrunk to one request in flight): the error envelope a replica would
answer with on that route: OpenAI's on /v1 (OpenAI's `type`, the reason in `code`), the
Open Inference Protocol's on /v2 (a string), the server's own elsewhere."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.support.envoy import (
    ENVOY_YAML,
    HealthyReplica,
    free_ports,
    local_envoy_config,
    running_envoy,
    upstream_cluster,
    wait_for,
)


class _Holding(HealthyReplica):
    """A replica which holds every POST until released."""

    arrived = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).arrived.set()
        type(self).release.wait(10)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


def post(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("POST", path, b'{"input": "x"}', {"content-type": "application/json"})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        connection.close()


@pytest.fixture
def holding_replica() -> Iterator[tuple[int, type[_Holding]]]:
    handler = type(
        "Holding", (_Holding,), {"arrived": threading.Event(), "release": threading.Event()}
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1]), handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("path", "error_type"),
    [
        ("/v1/embeddings", "rate_limit_exceeded"),
        ("/v2/models/m/infer", None),  # the Open Inference Protocol's: error is a string
        ("/v2", None),  # its server metadata route, no slash
        ("/infer", "inflight"),
    ],
)
def test_envoy_answers_its_overflow_in_the_routes_error_envelope(
    tmp_path: Path, holding_replica: tuple[int, type[_Holding]], path: str, error_type: str | None
) -> None:
    port, handler = holding_replica
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [port])
    breakers = upstream_cluster(config)["circuit_breakers"]["thresholds"][0]
    breakers.update(max_requests=1)  # a second request in flight overflows
    with running_envoy(tmp_path, config) as envoy:
        wait_for(lambda: envoy.host_healthy(port), 10, "a healthy replica")
        first = threading.Thread(target=post, args=(envoy.listener_port, path))
        first.start()
        assert handler.arrived.wait(10), "the first request reached the replica"
        status, headers, body = post(envoy.listener_port, path)  # over the breakers
        handler.release.set()
        first.join(10)
    assert status == 429 and headers["retry-after"] == "1"
    assert headers["content-type"] == "application/json"
    error = json.loads(body)["error"]
    if error_type is None:
        assert error.startswith("over capacity")
    else:
        assert (error["type"], error["code"]) == (error_type, "inflight")


def test_every_overflow_mapper_adds_the_one_retry_after_definition() -> None:
    """The mappers alias one `headers_to_add` (a YAML anchor), so an edit to Retry-After
    cannot reach one envelope and miss another. Envoy expands the alias: the live test above
    runs a config dumped with it (PyYAML writes a shared list as an alias) and every route's
    overflow carries `retry-after: 1`."""
    config = yaml.safe_load(ENVOY_YAML.read_text())
    listener = config["static_resources"]["listeners"][0]
    manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
    mappers = manager["local_reply_config"]["mappers"]
    first = mappers[0]["headers_to_add"]
    assert all(mapper["headers_to_add"] is first for mapper in mappers)
    assert [h["header"] for h in first] == [{"key": "retry-after", "value": "1"}]
