"""Overload without collapse, end to end: a real `steadyserve serve` flooded by closed-loop
clients that resend the moment they get a 429, once directly and once through a real Envoy
running the shipped deploy/envoy/envoy.yaml. All on 127.0.0.1, bounded in connections and
time; every process is started here and stopped by its PID.

What is asserted under the flood (counts, never rates): no 5xx, no connection refused,
reset, closed or timed out, only 200s and 429s, every 429 with Retry-After and a JSON error
naming a rejection reason, some 429s and still some 200s completed within the flood's
window; directly, at least half of the server's refusals decided before the body was read;
through Envoy, part of the overflow answered by Envoy itself and no 5xx from the replica.

Goodput's share of what the same server does at low concurrency is a rate: it is printed
here but not asserted (no timed assertions on a shared 2-core machine that also runs the
flooding client). loadtest/overload_bench.py measures and reports it (its "vs first"
column); the targets are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from app.api.errors import REJECTION_STATUS
from tests.support.envoy import (
    free_ports,
    local_envoy_config,
    running_envoy,
    upstream_cluster,
    wait_for,
)
from tests.support.flood import FloodResult, flood
from tests.support.server import REPO_ROOT, ServerProcess, running_server

pytestmark = pytest.mark.e2e

INFER_BODY = json.dumps(
    {"inputs": "a steady sentence of about twelve words for the flood"}
).encode()
LOW_CONNECTIONS = 64
FLOOD_CONNECTIONS = 300
LOW_SECONDS = 3.0
FLOOD_SECONDS = 4.0
# Of the refusals the server itself answered during the direct flood, at least this share
# must have been decided before the body was read. In the collapse of issue 7 it was none:
# every request was read, parsed and tokenized first, and goodput fell 10x. Measured here:
# 99 %+. (Goodput itself is a rate, measured by loadtest/overload_bench.py, not asserted.)
MIN_REFUSED_BEFORE_THE_BODY = 0.5

REASONS_ANSWERED_429 = {
    reason.value for reason, status in REJECTION_STATUS.items() if status == 429
}


def replica_inflight() -> int:
    """The shipped per-replica capacity the Envoy breakers derive from (deploy/baseline.yaml)."""
    baseline = yaml.safe_load((REPO_ROOT / "deploy" / "baseline.yaml").read_text())
    return int(baseline["capacity"]["replica_inflight"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(tmp_path_factory.mktemp("overload")) as process:
        yield process


def assert_no_collapse(low: FloodResult, flooded: FloodResult) -> None:
    summary = f"low: {low}\nflood: {flooded}"
    for result in (low, flooded):
        assert result.server_errors == 0, summary
        assert not result.failures, summary
        assert result.missing_retry_after == 0, summary
        assert set(result.statuses) <= {200, 429}, summary
    assert low.statuses[200] > 0, summary
    # The flood really overloaded the server (some of it was refused), and admitted work
    # still completed under it.
    assert flooded.statuses[429] > 0 and flooded.ok_in_window > 0, summary
    for body in flooded.rejection_bodies:
        error = json.loads(body)["error"]
        assert error["type"] in REASONS_ANSWERED_429, body
        assert error["message"] and "param" in error, body


def test_direct_flood_sheds_before_the_body_and_cleanly(server: ServerProcess) -> None:
    low = flood(server.port, LOW_CONNECTIONS, LOW_SECONDS, INFER_BODY)
    before = server.rejections()
    flooded = flood(server.port, FLOOD_CONNECTIONS, FLOOD_SECONDS, INFER_BODY)
    refused = server.rejections() - before
    print(f"\ndirect, {LOW_CONNECTIONS}: {low.summary()}\n{FLOOD_CONNECTIONS}: {flooded.summary()}")
    print(f"goodput share {flooded.ok_per_s / low.ok_per_s:.2f}; server refusals {dict(refused)}")
    assert_no_collapse(low, flooded)
    before_the_body = sum(n for (model, _), n in refused.items() if model == "")
    assert before_the_body >= MIN_REFUSED_BEFORE_THE_BODY * sum(refused.values()), refused


def test_flood_through_envoy_is_shed_by_envoy_itself(tmp_path: Path, server: ServerProcess) -> None:
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [server.port])
    # The shipped breakers are sized for the HPA's 8 replicas; here there is one, so the
    # test applies the same rule (baseline capacity.replica_inflight x replicas) to it.
    # Everything else, max_pending_requests and the overflow's local reply included, is
    # the shipped file.
    thresholds = upstream_cluster(config)["circuit_breakers"]["thresholds"][0]
    thresholds["max_connections"] = thresholds["max_requests"] = replica_inflight()
    with running_envoy(tmp_path, config) as envoy:
        wait_for(
            lambda: envoy.host_healthy(server.port),
            timeout=20,
            what="Envoy's health check to pass on the replica",
        )
        low = flood(envoy.listener_port, LOW_CONNECTIONS, LOW_SECONDS, INFER_BODY)
        flooded = flood(envoy.listener_port, FLOOD_CONNECTIONS, FLOOD_SECONDS, INFER_BODY)
        counters = envoy.stats("cluster.steadyserve.") | envoy.stats("http.ingress_http.")
    print(f"\nenvoy, {LOW_CONNECTIONS}: {low.summary()}\n{FLOOD_CONNECTIONS}: {flooded.summary()}")
    assert_no_collapse(low, flooded)
    # Envoy answered part of the overflow itself, without a request reaching the replica.
    overflows = counters["cluster.steadyserve.upstream_rq_pending_overflow"]
    assert overflows > 0, counters
    # Clients saw no 5xx; the cluster's 5xx are exactly Envoy's overflows (which Envoy
    # charges as an upstream 503 before the local reply turns it into a 429), none from the
    # replica.
    assert counters.get("http.ingress_http.downstream_rq_5xx", 0) == 0, counters
    assert counters.get("cluster.steadyserve.upstream_rq_5xx", 0) == overflows, counters
    # The overflow's own answer is among the 429 bodies.
    assert any(
        b"the replicas hold as many requests" in body for body in flooded.rejection_bodies
    ), flooded.rejection_bodies
