"""The shipped Envoy config in front of two real steadyserve processes, all on 127.0.0.1.

The Envoy config is deploy/envoy/envoy.yaml with only addresses and ports substituted
(tests/support/envoy.py); a test that changes a limit says so. Every wait polls for the
condition with a bound; every process is started here and stopped by its PID.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.envoy import (
    EnvoyProcess,
    free_ports,
    local_envoy_config,
    post_json,
    running_envoy,
    upstream_cluster,
    wait_for,
)
from tests.support.server import (
    ServerProcess,
    http_status,
    running_server,
    start_server,
)

pytestmark = pytest.mark.e2e

# Envoy connects from 127.0.0.1 here: trusted as the deployment trusts the Envoy tier's pod
# addresses, so its connections are never paused after a refusal (deploy/README.md).
BEHIND_ENVOY = {"STEADY_TRUSTED_PROXIES": '["127.0.0.1"]'}
# No replica sheds on its predicted delay (the default budget is 100 ms): on a busy machine
# (CI) a replica's delay admission answers 429 under these tests' load, and Envoy's retries
# of it land on another replica that may shed too (the 429 test's healthy one), or on one
# that is leaving (the drain test's, 503): refusals under load, not what the tests are
# about. The shedding those tests rely on is a token bucket's (SATURATED_ENV) and a drain's.
NO_DELAY_SHEDDING = {**BEHIND_ENVOY, "STEADY_MAX_QUEUE_DELAY_MS": "60000"}
INFER_BODY = json.dumps({"inputs": "steady tails through envoy"}).encode()
# One replica answers 429 to nearly everything: a 16-token bucket (the largest request of its
# one 16-token length bucket) refilled at 16 tokens/s, about one request a second, no
# waiting for a token, so Retry-After is 1 s (whole seconds, at least 1).
SATURATED_ENV = {
    **BEHIND_ENVOY,
    "STEADY_LENGTH_BUCKETS": "[16]",
    "STEADY_RATE_LIMIT_PER_S": "16",
    "STEADY_RATE_LIMIT_BURST": "16",
    "STEADY_MAX_INPUTS_PER_REQUEST": "1",
    "STEADY_MAX_ADMISSION_WAIT_MS": "0",
}


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, ...]]:
    """Two ready replicas with the test defaults but no delay shedding (NO_DELAY_SHEDDING),
    shared by the tests that stop neither."""
    logs = tmp_path_factory.mktemp("replicas")
    with (
        running_server(logs, NO_DELAY_SHEDDING) as first,
        running_server(logs, NO_DELAY_SHEDDING) as second,
    ):
        yield first, second


def envoy_in_front_of(
    tmp_path: Path, *replicas: ServerProcess, upstream_reuse_limit: int | None = None
) -> contextlib.AbstractContextManager[EnvoyProcess]:
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [r.port for r in replicas])
    if upstream_reuse_limit is not None:
        options = upstream_cluster(config)["typed_extension_protocol_options"][
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
        ]
        options["common_http_protocol_options"]["max_requests_per_connection"] = (
            upstream_reuse_limit
        )
    return running_envoy(tmp_path, config)


def wait_until_healthy(envoy: EnvoyProcess, *replicas: ServerProcess) -> None:
    wait_for(
        lambda: all(envoy.host_healthy(r.port) for r in replicas),
        timeout=20,
        what="Envoy's health check to pass on every replica",
    )


def send_sequentially(envoy: EnvoyProcess, count: int) -> Counter[int]:
    """`count` requests on one kept-alive client connection; their status codes."""
    statuses: Counter[int] = Counter()
    connection = http.client.HTTPConnection("127.0.0.1", envoy.listener_port)
    try:
        for _ in range(count):
            status, _, _ = post_json(connection, "/infer", INFER_BODY)
            statuses[status] += 1
    finally:
        connection.close()
    return statuses


def send_concurrently(
    envoy: EnvoyProcess, count: int, concurrency: int
) -> list[tuple[int, dict[str, str]]]:
    """`count` requests from `concurrency` threads, each its own connection."""

    def one(_: int) -> tuple[int, dict[str, str]]:
        connection = http.client.HTTPConnection("127.0.0.1", envoy.listener_port)
        try:
            status, headers, _ = post_json(connection, "/infer", INFER_BODY)
            return status, headers
        finally:
            connection.close()

    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        return list(pool.map(one, range(count)))


def test_requests_succeed_and_the_upstream_reuse_limit_takes_effect(
    tmp_path: Path, replicas: tuple[ServerProcess, ...]
) -> None:
    first, second = replicas
    # The shipped limits: one client connection carries every request, and no upstream
    # connection is closed for having served too many.
    with envoy_in_front_of(tmp_path, first, second) as envoy:
        wait_until_healthy(envoy, first, second)
        assert send_sequentially(envoy, 40) == Counter({200: 40})
        stats = envoy.stats()
        assert stats["http.ingress_http.downstream_cx_total"] == 1
        assert stats["cluster.steadyserve.upstream_cx_max_requests"] == 0
        for replica in (first, second):
            assert int(envoy.host_stats(replica.port)["rq_total"]) > 0

    # The test's copy lowers the upstream limit to 5: Envoy closes each upstream
    # connection after 5 requests and opens a new one, and counts it.
    with envoy_in_front_of(tmp_path, first, second, upstream_reuse_limit=5) as envoy:
        wait_until_healthy(envoy, first, second)
        assert send_sequentially(envoy, 40) == Counter({200: 40})
        stats = envoy.stats()
        assert stats["http.ingress_http.downstream_cx_total"] == 1
        # 40 requests over connections of at most 5: at least 6 reached the limit.
        assert stats["cluster.steadyserve.upstream_cx_max_requests"] >= 6
        assert stats["cluster.steadyserve.upstream_cx_total"] >= 8


def test_429_from_a_saturated_replica_is_retried_on_the_other_never_a_5xx(
    tmp_path: Path, replicas: tuple[ServerProcess, ...]
) -> None:
    healthy = replicas[0]
    with running_server(tmp_path, SATURATED_ENV) as saturated:
        with envoy_in_front_of(tmp_path, saturated, healthy) as envoy:
            wait_until_healthy(envoy, saturated, healthy)
            results = send_concurrently(envoy, count=24, concurrency=8)
            stats = envoy.stats()
        statuses = Counter(status for status, _ in results)
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[200] >= 16, statuses
        # Answers that were retried are counted under `retry.`: the saturated replica's 429s.
        assert stats["cluster.steadyserve.retry.upstream_rq_429"] >= 1
        assert stats["cluster.steadyserve.upstream_rq_retry_success"] >= 1
        # The retry waited for the replica's Retry-After instead of the exponential back-off.
        assert stats["cluster.steadyserve.upstream_rq_retry_backoff_ratelimited"] >= 1
        assert stats.get("cluster.steadyserve.upstream_rq_5xx", 0) == 0
        assert stats.get("http.ingress_http.downstream_rq_5xx", 0) == 0

        # With no other replica to go to, the client gets the 429 and its Retry-After. The
        # token bucket admits at most ~5 of 10 requests in the ~3 s the retries take.
        with envoy_in_front_of(tmp_path, saturated) as envoy:
            wait_until_healthy(envoy, saturated)
            results = send_concurrently(envoy, count=10, concurrency=10)
            stats = envoy.stats()
        statuses = Counter(status for status, _ in results)
        assert set(statuses) <= {200, 429}, statuses
        assert statuses[429] >= 3, statuses
        assert all(int(headers["retry-after"]) >= 1 for s, headers in results if s == 429)
        assert stats.get("http.ingress_http.downstream_rq_5xx", 0) == 0


class LoadThroughEnvoy:
    """Closed-loop load from a few threads, each on its own kept-alive connection; records
    every outcome (a status code, or the exception's name if no response came back)."""

    def __init__(self, envoy: EnvoyProcess, threads: int) -> None:
        self._envoy = envoy
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.outcomes: list[int | str] = []
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def __enter__(self) -> LoadThroughEnvoy:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)

    def count(self) -> int:
        with self._lock:
            return len(self.outcomes)

    def _run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self._envoy.listener_port)
        while not self._stop.is_set():
            outcome: int | str
            try:
                outcome, _, _ = post_json(connection, "/infer", INFER_BODY, timeout_s=30)
            except (OSError, http.client.HTTPException) as error:
                outcome = type(error).__name__
                connection.close()
                connection = http.client.HTTPConnection("127.0.0.1", self._envoy.listener_port)
            with self._lock:
                self.outcomes.append(outcome)
        connection.close()


def test_sigterm_to_a_replica_under_load_loses_no_request(tmp_path: Path) -> None:
    with (
        running_server(tmp_path, NO_DELAY_SHEDDING) as staying,
        running_server(tmp_path, NO_DELAY_SHEDDING) as leaving,
        envoy_in_front_of(tmp_path, staying, leaving) as envoy,
    ):
        wait_until_healthy(envoy, staying, leaving)
        with LoadThroughEnvoy(envoy, threads=4) as load:
            wait_for(
                lambda: (
                    load.count() >= 40 and int(envoy.host_stats(leaving.port)["rq_total"]) >= 10
                ),
                timeout=60,
                what="load to reach both replicas",
            )
            leaving.terminate()  # SIGTERM, by PID
            exit_code = leaving.wait(timeout=40)
            after_exit = load.count()
            wait_for(
                lambda: load.count() >= after_exit + 40,
                timeout=60,
                what="load to carry on through the remaining replica",
            )
        # The health check takes the replica that went away out of the cluster.
        wait_for(
            lambda: "failed_active_hc" in envoy.host_stats(leaving.port)["health_flags"],
            timeout=15,
            what="Envoy's health check to mark the terminated replica",
        )
        # What Envoy did about the refusals, to tell a failure's cause (retries exhausted,
        # a retry on the draining replica again, or the retry budget) from its stats.
        retries = envoy.stats("cluster.steadyserve.upstream_rq_retry")
        answered = envoy.stats("cluster.steadyserve.upstream_rq_5")
    outcomes = Counter(load.outcomes)
    assert exit_code == 0, leaving.log()
    assert outcomes == Counter({200: len(load.outcomes)}), (outcomes, retries, answered)


@contextlib.contextmanager
def replica_that_never_gets_ready(tmp_path: Path) -> Iterator[ServerProcess]:
    """A real steadyserve whose start-up fails (its model source does not exist): it stays
    up and never gets ready (its front end's start-up fails, so it never listens on the
    traffic port, and is restarted with backoff). Its port is never bound, and never handed
    out again (`free_port`): the Envoy started in front of it cannot be given it."""
    broken_model = [{"name": "broken", "source": str(tmp_path / "no-such-model")}]
    replica = start_server(tmp_path, {**BEHIND_ENVOY, "STEADY_MODELS": json.dumps(broken_model)})
    try:
        wait_for(
            lambda: "front-end start-up failed" in replica.log(),
            timeout=60,
            what="the broken replica's front end to fail its start-up",
        )
        assert replica.process.poll() is None, replica.log()
        yield replica
    finally:
        replica.kill()


def test_an_unready_replica_is_taken_out_by_the_health_check(
    tmp_path: Path, replicas: tuple[ServerProcess, ...]
) -> None:
    ready = replicas[0]
    with (
        replica_that_never_gets_ready(tmp_path) as unready,
        envoy_in_front_of(tmp_path, ready, unready) as envoy,
    ):
        wait_until_healthy(envoy, ready)
        wait_for(
            lambda: "failed_active_hc" in envoy.host_stats(unready.port)["health_flags"],
            timeout=15,
            what="Envoy's health check to mark the unready replica",
        )
        assert send_sequentially(envoy, 30) == Counter({200: 30})
        # Every try went to the ready replica (a 429 from its token bucket is retried, on it).
        assert int(envoy.host_stats(ready.port)["rq_total"]) >= 30
        assert int(envoy.host_stats(unready.port)["rq_total"]) == 0
        assert unready.process.poll() is None, "the unready replica must still be running"
        # Its front end's start-up fails and is retried with backoff, never listening on
        # the traffic port: never ready.
        assert http_status(f"{unready.base_url}/readyz") is None
