"""The shipped Envoy's outlier detection, run in a real Envoy against stub replicas: a
replica is ejected for its own failures (connections reset or refused), never for answers
a client's request earned, such as a 504 for a deadline it could not meet."""

from __future__ import annotations

import http.client
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import ThreadingHTTPServer
from pathlib import Path

from app.admission import RejectReason
from app.api.errors import REJECTION_STATUS
from tests.support.envoy import (
    UPSTREAM_CLUSTER,
    HealthyReplica,
    free_ports,
    local_envoy_config,
    running_envoy,
    wait_for,
)

EJECTED = f"cluster.{UPSTREAM_CLUSTER}.outlier_detection.ejections_enforced_total"
REQUESTS = 12  # four times the consecutive failures that ejected a replica before
GONE_REQUESTS = 40


class _DeadlineRefusing(HealthyReplica):
    """Answers every POST as a healthy replica answers a deadline it cannot meet."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = json.dumps({"error": {"type": "deadline", "code": "deadline"}}).encode()
        self.send_response(REJECTION_STATUS[RejectReason.DEADLINE])
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Answering(HealthyReplica):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@contextmanager
def replicas(*handlers: type[HealthyReplica]) -> Iterator[list[ThreadingHTTPServer]]:
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for handler in handlers]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield servers
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def port_of(server: ThreadingHTTPServer) -> int:
    return int(server.server_address[1])


def post_through(port: int, count: int) -> list[int]:
    statuses = []
    for _ in range(count):
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            connection.request(
                "POST", "/infer", b'{"inputs": "x"}', {"content-type": "application/json"}
            )
            statuses.append(connection.getresponse().status)
        finally:
            connection.close()
    return statuses


def test_replicas_answering_504_for_client_deadlines_stay_in_rotation(tmp_path: Path) -> None:
    """Clients with deadlines shorter than the queue get 504 from healthy replicas; counted
    as gateway failures, three in a row ejected a replica for 30 s (half the fleet at
    worst), just when capacity was short."""
    with replicas(_DeadlineRefusing, _DeadlineRefusing) as servers:
        ports = [port_of(server) for server in servers]
        listener, stats, admin = free_ports(3)
        with running_envoy(tmp_path, local_envoy_config(listener, stats, admin, ports)) as envoy:
            wait_for(lambda: all(envoy.host_healthy(p) for p in ports), 10, "healthy replicas")
            statuses = post_through(envoy.listener_port, REQUESTS)
            ejected = envoy.stats(EJECTED).get(EJECTED)
    assert statuses == [504] * REQUESTS
    assert ejected == 0


def test_a_replica_that_stops_listening_is_ejected(tmp_path: Path) -> None:
    """The failures that are the replica's own still take it out of rotation at once, before
    the health check's two misses (4 s): a replica whose process is gone refuses
    connections, and the requests are retried on the other one."""
    with replicas(_Answering, _Answering) as (gone, answering):
        ports = [port_of(gone), port_of(answering)]
        listener, stats, admin = free_ports(3)
        with running_envoy(tmp_path, local_envoy_config(listener, stats, admin, ports)) as envoy:
            wait_for(lambda: all(envoy.host_healthy(p) for p in ports), 10, "healthy replicas")
            gone.shutdown()
            gone.server_close()  # its port now refuses connections
            # Enough that the gone replica is picked at least 3 times (each pick is a coin
            # flip between the two: at 12, 2 % of runs picked it twice or less).
            statuses = post_through(envoy.listener_port, GONE_REQUESTS)
            ejected = envoy.stats(EJECTED).get(EJECTED)
            refused = envoy.host_stats(ports[0])
    assert statuses == [200] * GONE_REQUESTS
    assert ejected == 1, refused
