"""The closed-loop flood through Envoy, before and after a change to deploy/envoy/envoy.yaml.

Starts one `steadyserve serve` with the default settings (what `make serve` runs) on
127.0.0.1, then for each Envoy config (the shipped file at a git revision, or the working
tree's) starts Envoy in front of it exactly as tests/e2e does (addresses and ports only), and
runs a flood script (e.g. the shared flood.sh: wrk, 429s resent at once) against Envoy. Every
process is started here and stopped by its PID.

    python -m loadtest.envoy_flood --flood /work/shared/tools/flood.sh \\
        --config main=HEAD~3 --config new=WORKTREE --connections 64 1500

`--per-replica-breakers` scales the upstream circuit breakers to the one replica here
(baseline capacity.replica_inflight x 1), as a fleet at its HPA maximum sees them per replica.
"""

from __future__ import annotations

import argparse
import contextlib
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from loadtest.local_envoy import (
    free_ports,
    local_envoy_config,
    running_envoy,
    upstream_cluster,
    wait_for,
)
from loadtest.localserver import REPO_ROOT, ServeProcess, free_port, start_serve

ENVOY_PATH = "deploy/envoy/envoy.yaml"


def _config_source(revision: str, workdir: Path) -> Path:
    if revision == "WORKTREE":
        return REPO_ROOT / ENVOY_PATH
    if Path(revision).is_file():  # a variant being tried, not yet committed
        return Path(revision)
    text = subprocess.run(
        ["git", "show", f"{revision}:{ENVOY_PATH}"],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = workdir / f"envoy-{revision.replace('/', '_').replace('~', '_')}.yaml"
    path.write_text(text)
    return path


def _replica_inflight() -> int:
    baseline = yaml.safe_load((REPO_ROOT / "deploy" / "baseline.yaml").read_text())
    return int(baseline["capacity"]["replica_inflight"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flood", required=True, help="flood script: SCRIPT URL CONNECTIONS...")
    parser.add_argument(
        "--config", action="append", required=True, help="NAME=REVISION, NAME=WORKTREE or NAME=FILE"
    )
    parser.add_argument("--connections", nargs="+", default=["64", "1500"])
    parser.add_argument("--per-replica-breakers", action="store_true")
    arguments = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="envoy-flood-"))
    with make_serve(workdir) as server:
        for spec in arguments.config:
            name, _, revision = spec.partition("=")
            listener, stats, admin = free_ports(3)
            config: dict[str, Any] = local_envoy_config(
                listener, stats, admin, [server.port], _config_source(revision, workdir)
            )
            thresholds = upstream_cluster(config)["circuit_breakers"]["thresholds"][0]
            if arguments.per_replica_breakers and revision != "WORKTREE" and "/" not in revision:
                pass  # a committed revision: its own sizing, as shipped then
            elif arguments.per_replica_breakers:
                thresholds["max_connections"] = thresholds["max_requests"] = _replica_inflight()
            with running_envoy(workdir, config) as envoy:
                wait_for(lambda: envoy.host_healthy(server.port), 20, "a healthy replica")
                print(
                    f"== {name} ({revision}): max_requests {thresholds['max_requests']}, "
                    f"max_pending_requests {thresholds['max_pending_requests']}",
                    flush=True,
                )
                subprocess.run(
                    ["bash", arguments.flood, envoy.url, *arguments.connections], check=True
                )
                counters = {
                    name: value
                    for name, value in envoy.stats().items()
                    if value
                    and any(
                        part in name
                        for part in (
                            "cluster.steadyserve.upstream_rq_pending_overflow",
                            "cluster.steadyserve.upstream_rq_5",
                            "cluster.steadyserve.upstream_rq_timeout",
                            "cluster.steadyserve.upstream_rq_retry",
                            "http.ingress_http.downstream_rq_5xx",
                            "http.ingress_http.downstream_rq_4xx",
                            "http.ingress_http.downstream_rq_2xx",
                        )
                    )
                    and not name.startswith("cluster.steadyserve.external")
                }
                print(f"   envoy: {counters}", flush=True)


@contextlib.contextmanager
def make_serve(workdir: Path) -> Iterator[ServeProcess]:
    """`steadyserve serve` as `make serve` runs it (default settings), ready; killed on exit."""
    server = start_serve(free_port(), {}, workdir / "steadyserve.log")
    try:
        server.wait_ready(300)
        yield server
    finally:
        server.kill()


if __name__ == "__main__":
    main()
