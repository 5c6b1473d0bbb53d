"""How an Envoy pod stops (deploy/envoy/README.md, "Shutdown"): the Service drops it while its
preStop hook sleeps, then SIGTERM, at which Envoy exits at once: it drains only when told to
(admin `POST /drain_listeners`, a hot restart, an LDS removal), never on SIGTERM, whatever its
`--drain-time-s`. The grace period must cover the sleep, plus the drain time if the container
is ever given one, and the live test pins the Envoy behaviour the timeline rests on."""

from __future__ import annotations

import http.client
import signal
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from app.checkconfig import render_kustomization
from tests.deploy.tools import DEPLOY
from tests.support.envoy import (
    HealthyReplica,
    free_ports,
    local_envoy_config,
    running_envoy,
    wait_for,
)

OVERLAYS = ("cpu", "gpu")
# What the kubelet leaves Envoy between SIGTERM and SIGKILL beyond the sleep and any drain:
# its exit takes milliseconds; the rest is room for a loaded node.
ENVOY_EXIT_MARGIN_S = 10


def envoy_pod(overlay: str) -> dict[str, Any]:
    manifests = render_kustomization(DEPLOY / "k8s" / "overlays" / overlay)
    deployment = next(
        m
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "steadyserve-envoy"
    )
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in a container's args."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(f"{name}="):
            return arg.partition("=")[2]
    return None


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_grace_period_covers_the_envoy_pods_sleep_and_drain(overlay: str) -> None:
    pod = envoy_pod(overlay)
    (container,) = pod["containers"]
    # The image is distroless: no shell for an exec hook, so the kubelet's own sleep.
    assert "distroless" in container["image"]
    pre_stop = container["lifecycle"]["preStop"]
    assert list(pre_stop) == ["sleep"], pre_stop
    sleep_s = int(pre_stop["sleep"]["seconds"])
    assert sleep_s > 0
    args = list(container.get("command", [])) + list(container.get("args", []))
    drain_time = flag(args, "--drain-time-s")
    # No drain runs at SIGTERM; a drain time given here is for a drain started before it
    # (a shutdown manager calling the admin), which the grace period must then cover.
    drain_s = int(drain_time) if drain_time is not None else 0
    assert flag(args, "--drain-strategy") in (None, "gradual", "immediate")
    grace_s = int(pod["terminationGracePeriodSeconds"])
    assert grace_s >= sleep_s + drain_s + ENVOY_EXIT_MARGIN_S, (grace_s, sleep_s, drain_s)


class _Holding(HealthyReplica):
    """A replica which holds every POST until released."""

    arrived = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        type(self).arrived.set()
        type(self).release.wait(30)
        self.send_response(200)
        self.send_header("content-length", "2")
        self.end_headers()
        self.wfile.write(b"{}")


@pytest.fixture
def holding_replica() -> Iterator[tuple[int, type[_Holding]]]:
    class Holding(_Holding):  # events of its own, not shared with another test's replica
        arrived = threading.Event()
        release = threading.Event()

    handler = Holding
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield int(server.server_address[1]), handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()


def test_envoy_exits_at_sigterm_without_waiting_for_a_request_in_flight(
    tmp_path: Path, holding_replica: tuple[int, type[_Holding]]
) -> None:
    """Run with Envoy's default drain time (600 s): a drain at SIGTERM would hold the
    request's answer; Envoy instead exits at once and the client's request is cut."""
    port, handler = holding_replica
    listener, stats, admin = free_ports(3)
    outcome: list[object] = []

    def client() -> None:
        connection = http.client.HTTPConnection("127.0.0.1", listener, timeout=30)
        try:
            connection.request("POST", "/infer", b'{"input": "x"}')
            outcome.append(connection.getresponse().status)
        except (OSError, http.client.HTTPException) as error:
            outcome.append(error)
        finally:
            connection.close()

    with running_envoy(tmp_path, local_envoy_config(listener, stats, admin, [port])) as envoy:
        wait_for(lambda: envoy.host_healthy(port), 10, "a healthy replica")
        request = threading.Thread(target=client)
        request.start()
        assert handler.arrived.wait(10), "the request reached the replica"
        envoy.process.send_signal(signal.SIGTERM)
        envoy.process.wait(timeout=10)  # exited while the replica still held the request
        assert not handler.release.is_set()
        request.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], Exception), outcome
    assert "caught ENVOY_SIGTERM" in envoy.log()
