"""`steadyserve check-config`: the deployed limits must equal deploy/baseline.yaml.

Three sources are read and compared with the baseline, value by value:

* the app's settings: `Settings()` (defaults + STEADY_* environment of this process) and, for
  each overlay under deploy/k8s/overlays (a tree without any: its base, as the overlay
  `base`), the settings a pod would get from its ConfigMap and container env;
* deploy/envoy/envoy.yaml (connection-reuse and buffer limits, retries, health checks, ...);
* the Kubernetes manifests rendered from each overlay (probes, grace period, resources, HPA).

Every difference is printed with both values. Exit status: 0 when nothing differs, 1 when
anything does, 2 on a config or usage error (a file it cannot read, parse or check, a setting
the server would refuse to start with, a baseline key nothing reads, a bad argument: one line
on stderr, never a traceback). The
manifests are rendered by `render_kustomization`, a small kustomize that understands exactly
the subset the shipped kustomizations use and refuses anything else, so the files stay valid
for `kubectl kustomize` too (tests/deploy compares the two where kubectl exists).

Single-threaded command-line code; nothing here runs inside the server.
"""

from app.checkconfig.common import ConfigError
from app.checkconfig.compare import main, parse_arguments
from app.checkconfig.kustomize import render_kustomization, strategic_merge

__all__ = ["ConfigError", "main", "parse_arguments", "render_kustomization", "strategic_merge"]
