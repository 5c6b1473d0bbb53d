"""A request's deadline, from what its client and the proxy in front asked for. Pure: the
caller passes the clock's reading; any thread."""

from __future__ import annotations

from app.admission import AdmissionLimits

# Taken off the proxy's timeout (at most this share of it): Envoy's route timer started
# before the request reached the replica, so a replica answering at the proxy's deadline
# answers after it, and Envoy's own timeout counts against the replica as a local-origin
# failure, three of which eject it (deploy/envoy/envoy.yaml). The replica answers first.
PROXY_TIMEOUT_MARGIN_S = 0.1
PROXY_TIMEOUT_MARGIN_SHARE = 0.1


def resolve_deadline(
    now: float,
    limits: AdmissionLimits,
    timeout_ms: float | None = None,
    envoy_timeout_ms: float | None = None,
) -> float:
    """The request's monotonic deadline: the tightest of what the client and the proxy asked
    for (the proxy's less `PROXY_TIMEOUT_MARGIN_S`, or its share), the default when neither
    did, and never beyond `max_timeout_s`."""
    asked = [timeout_ms / 1000.0] if timeout_ms is not None and timeout_ms > 0 else []
    if envoy_timeout_ms is not None and envoy_timeout_ms > 0:
        proxy_s = envoy_timeout_ms / 1000.0
        asked.append(proxy_s - min(PROXY_TIMEOUT_MARGIN_S, PROXY_TIMEOUT_MARGIN_SHARE * proxy_s))
    timeout_s = min(asked) if asked else limits.default_timeout_s
    return now + min(timeout_s, limits.max_timeout_s)
