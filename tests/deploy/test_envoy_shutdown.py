"""How an Envoy pod stops (deploy/envoy/README.md, "Shutdown"). Envoy drains only when told to
(admin `POST /drain_listeners?graceful`, a hot restart, an LDS removal), never on SIGTERM, and
its distroless image has no shell for a hook: the pod's `envoy-drain` container POSTs the drain
to Envoy's admin from its preStop hook while Envoy's own preStop sleep keeps it serving, and
SIGTERM comes once the drain window and the longest route have passed.

The relationship test reads the rendered manifests of each overlay and the envoy.yaml they
ship (the admin address the hook must reach, the longest route a request may take); the live
tests run the real Envoy with the Deployment's drain flags and the hook's own request."""

from __future__ import annotations

import http.client
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import pytest
import yaml

from app.checkconfig import render_kustomization
from app.checkconfig.envoy_config import read_envoy
from tests.deploy.tools import DEPLOY
from tests.support.envoy import (
    HealthyReplica,
    free_ports,
    http_get,
    local_envoy_config,
    post_json,
    running_envoy,
    wait_for,
)

OVERLAYS = ("cpu", "gpu")
ENVOY_CONTAINER = "envoy"
DRAIN_CONTAINER = "envoy-drain"
# What the kubelet leaves Envoy between SIGTERM and SIGKILL beyond its preStop sleep: its exit
# takes milliseconds; the rest is room for a loaded node.
ENVOY_EXIT_MARGIN_S = 10
# The envoy.yaml routes whose timeouts bound a request through Envoy (check-config's names).
ROUTE_TIMEOUTS = ("route_timeout_s", "completions_route_timeout_s", "chat_route_timeout_s")
# The ingress listener's HCM stat_prefix in envoy.yaml.
INGRESS_STATS = "http.ingress_http."
ADMIN_URL = re.compile(r"http://(?P<host>[^/:\s'\"]+):(?P<port>\d+)(?P<request>/[^\s'\"]*)")


@dataclass(frozen=True)
class EnvoyShutdown:
    """What one overlay's Envoy pod does when it stops, read from its rendered manifests."""

    pod: dict[str, Any]
    envoy: dict[str, Any]  # the Envoy container
    drainer: dict[str, Any]  # the container whose preStop starts the drain
    hook: str  # the drainer's preStop command line, joined
    admin_host: str  # envoy.yaml's admin socket address
    admin_port: int
    longest_route_s: float  # the longest route timeout in envoy.yaml

    @property
    def drain_request(self) -> str:
        """The path and query the hook POSTs to the admin interface."""
        match = ADMIN_URL.search(self.hook)
        assert match is not None, f"no admin URL in the drain hook: {self.hook}"
        return match.group("request")

    @property
    def drain_flags(self) -> list[str]:
        """Envoy's drain flags as the Deployment gives them."""
        flags: list[str] = []
        for name in ("--drain-time-s", "--drain-strategy"):
            value = flag(container_args(self.envoy), name)
            if value is not None:
                flags += [name, value]
        return flags


def container_args(container: dict[str, Any]) -> list[str]:
    return [str(arg) for arg in [*container.get("command", []), *container.get("args", [])]]


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in a container's args."""
    for index, arg in enumerate(args):
        if arg == name and index + 1 < len(args):
            return args[index + 1]
        if arg.startswith(f"{name}="):
            return arg.partition("=")[2]
    return None


def envoy_shutdown(overlay: str) -> EnvoyShutdown:
    manifests = render_kustomization(DEPLOY / "k8s" / "overlays" / overlay)
    deployment = next(
        m
        for m in manifests
        if m["kind"] == "Deployment" and m["metadata"]["name"] == "steadyserve-envoy"
    )
    pod: dict[str, Any] = deployment["spec"]["template"]["spec"]
    containers = {container["name"]: container for container in pod["containers"]}
    assert set(containers) == {ENVOY_CONTAINER, DRAIN_CONTAINER}, sorted(containers)
    drainer = containers[DRAIN_CONTAINER]
    hook = " ".join(drainer["lifecycle"]["preStop"]["exec"]["command"])
    # The envoy.yaml this pod mounts: its ConfigMap, by the (hashed) name the volume gives.
    config_map_name = next(v["configMap"]["name"] for v in pod["volumes"] if "configMap" in v)
    config_map = next(
        m
        for m in manifests
        if m["kind"] == "ConfigMap" and m["metadata"]["name"] == config_map_name
    )
    config = yaml.safe_load(config_map["data"]["envoy.yaml"])
    admin = config["admin"]["address"]["socket_address"]
    routes = read_envoy(config)
    return EnvoyShutdown(
        pod=pod,
        envoy=containers[ENVOY_CONTAINER],
        drainer=drainer,
        hook=hook,
        admin_host=str(admin["address"]),
        admin_port=int(admin["port_value"]),
        longest_route_s=max(float(routes[name]) for name in ROUTE_TIMEOUTS),
    )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_drain_hook_reaches_envoys_admin_and_the_timeline_fits(overlay: str) -> None:
    """drain start (the hook) -> drain window + longest route <= Envoy's preStop sleep
    < terminationGracePeriodSeconds, with the hook POSTing to the admin envoy.yaml sets."""
    shutdown = envoy_shutdown(overlay)
    # Envoy's image is distroless: no shell for an exec hook, so the kubelet's own sleep.
    assert "distroless" in shutdown.envoy["image"]
    pre_stop = shutdown.envoy["lifecycle"]["preStop"]
    assert list(pre_stop) == ["sleep"], pre_stop
    sleep_s = int(pre_stop["sleep"]["seconds"])

    # The hook POSTs a graceful drain of every listener to the admin the pod's Envoy has
    # (loopback: the pod's containers share it). `inboundonly` would drain none of them:
    # envoy.yaml's listeners set no traffic_direction.
    match = ADMIN_URL.search(shutdown.hook)
    assert match is not None, shutdown.hook
    assert (match.group("host"), int(match.group("port"))) == (
        shutdown.admin_host,
        shutdown.admin_port,
    )
    assert shutdown.admin_host == "127.0.0.1"
    assert re.search(r"(^|\s)-X\s+POST\s", shutdown.hook), shutdown.hook
    path, _, query = shutdown.drain_request.partition("?")
    assert path == "/drain_listeners"
    params = parse_qs(query, keep_blank_values=True)
    assert "graceful" in params and "inboundonly" not in params, params

    # Every connection is told to close from the drain's start (the live test below); the
    # listeners accept for the drain window, so the last request may start at its end and
    # run for the longest route, before SIGTERM cuts whatever is left.
    args = container_args(shutdown.envoy)
    assert flag(args, "--drain-strategy") == "immediate", args
    drain_time = flag(args, "--drain-time-s")
    assert drain_time is not None, args
    drain_s = int(drain_time)
    assert 0 < drain_s <= sleep_s
    assert drain_s + shutdown.longest_route_s <= sleep_s, (
        drain_s,
        shutdown.longest_route_s,
        sleep_s,
    )
    grace_s = int(shutdown.pod["terminationGracePeriodSeconds"])
    assert grace_s >= sleep_s + ENVOY_EXIT_MARGIN_S, (grace_s, sleep_s)
    # The hook's own wait ends within the grace period (the kubelet would cut it there).
    assert all(int(s) < grace_s for s in re.findall(r"\bsleep\s+(\d+)", shutdown.hook))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_drain_container_is_pinned_small_and_locked_down(overlay: str) -> None:
    shutdown = envoy_shutdown(overlay)
    drainer = shutdown.drainer
    image, _, tag = drainer["image"].rpartition(":")
    assert image and re.fullmatch(r"\d+\.\d+\.\d+", tag), drainer["image"]
    resources = drainer["resources"]
    assert resources["requests"] == resources["limits"], resources
    assert set(resources["limits"]) == {"cpu", "memory"}
    assert shutdown.pod["securityContext"]["runAsNonRoot"] is True
    security = drainer["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"]["drop"] == ["ALL"]
    assert not drainer.get("ports"), "the drain container serves nothing"


HELD_PATH = "/held"


class _Holding(HealthyReplica):
    """A replica which holds each POST to HELD_PATH until released; other POSTs are
    answered at once."""

    arrived = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == HELD_PATH:
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


Outcome = tuple[int, dict[str, str]] | Exception


def _post(port: int, path: str, outcome: list[Outcome]) -> None:
    """One POST on a new connection; appends (status, lower-cased headers) or the error."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        status, headers, _ = post_json(connection, path, b'{"input": "x"}')
        outcome.append((status, headers))
    except (OSError, http.client.HTTPException) as error:
        outcome.append(error)
    finally:
        connection.close()


def test_the_hooks_drain_closes_kept_alive_connections_and_lets_requests_finish(
    tmp_path: Path, holding_replica: tuple[int, type[_Holding]]
) -> None:
    """The real Envoy, with the Deployment's drain flags, sent the hook's own admin request:
    a kept-alive connection's next response says `connection: close`, a request in flight
    finishes (and closes its connection), a new connection is still served once, no
    connection is closed with a request on it, and Envoy keeps running (SIGTERM, after its
    sleep, is what stops it)."""
    shutdown = envoy_shutdown("cpu")
    port, handler = holding_replica
    listener, stats, admin = free_ports(3)
    config = local_envoy_config(listener, stats, admin, [port])
    with running_envoy(tmp_path, config, extra_args=shutdown.drain_flags) as envoy:
        wait_for(lambda: envoy.host_healthy(port), 10, "a healthy replica")
        kept_alive = http.client.HTTPConnection("127.0.0.1", listener, timeout=30)
        status, headers, _ = post_json(kept_alive, "/infer", b'{"input": "x"}')
        assert (status, headers.get("connection")) == (200, None)
        in_flight: list[Outcome] = []
        request = threading.Thread(target=_post, args=(listener, HELD_PATH, in_flight))
        request.start()
        assert handler.arrived.wait(10), "the request reached the replica"

        drain = http.client.HTTPConnection("127.0.0.1", admin, timeout=5)
        drain.request("POST", shutdown.drain_request)
        drain_answer = drain.getresponse()
        assert drain_answer.status == 200, drain_answer.read()
        drain.close()

        status, headers, _ = post_json(kept_alive, "/infer", b'{"input": "x"}')
        assert (status, headers.get("connection")) == (200, "close")
        kept_alive.close()
        handler.release.set()
        request.join(30)
        late: list[Outcome] = []
        _post(listener, "/infer", late)  # a client whose kube-proxy still routes here
        for outcome in (*in_flight, *late):
            assert isinstance(outcome, tuple), outcome
            assert (outcome[0], outcome[1].get("connection")) == (200, "close")
        assert len(in_flight) == 1

        def drained_three() -> bool:
            closed = envoy.stats(INGRESS_STATS).get(f"{INGRESS_STATS}downstream_cx_drain_close")
            return (closed or 0) >= 3

        wait_for(drained_three, 10, "Envoy to count three connections closed by the drain")
        cut = envoy.stats(INGRESS_STATS)[f"{INGRESS_STATS}downstream_cx_destroy_local_active_rq"]
        assert cut == 0
        assert envoy.process.poll() is None
        assert http_get(f"http://127.0.0.1:{admin}/ready")[0] == 200


def test_envoy_exits_at_sigterm_without_waiting_for_a_request_in_flight(
    tmp_path: Path, holding_replica: tuple[int, type[_Holding]]
) -> None:
    """Why the drain must come before SIGTERM: run with Envoy's default drain time (600 s),
    a drain at SIGTERM would hold the request's answer; Envoy instead exits at once and the
    client's request is cut."""
    port, handler = holding_replica
    listener, stats, admin = free_ports(3)
    outcome: list[Outcome] = []
    with running_envoy(tmp_path, local_envoy_config(listener, stats, admin, [port])) as envoy:
        wait_for(lambda: envoy.host_healthy(port), 10, "a healthy replica")
        request = threading.Thread(target=_post, args=(listener, HELD_PATH, outcome))
        request.start()
        assert handler.arrived.wait(10), "the request reached the replica"
        envoy.process.send_signal(signal.SIGTERM)
        envoy.process.wait(timeout=10)  # exited while the replica still held the request
        assert not handler.release.is_set()
        request.join(10)
    assert len(outcome) == 1 and isinstance(outcome[0], Exception), outcome
    assert "caught ENVOY_SIGTERM" in envoy.log()
