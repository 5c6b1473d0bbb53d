"""uvicorn's warnings that any client can cause at will, dropped from a front end's log.

uvicorn's httptools protocol logs a WARNING on `uvicorn.error`, unbounded, for:

- bytes that do not parse as HTTP ("Invalid HTTP request received.", answered 400 and
  closed): TLS spoken to the plaintext port, a scanner, a broken client; one a connection.
  Counted where the protocol answers them, in `steadyserve_rejected_total{reason=
  "invalid_http"}` (`api/header_limits.py`), whatever the log level.
- a request asking to upgrade to anything but WebSocket ("Unsupported upgrade request.":
  `Connection: Upgrade` with `Upgrade: h2c`, as `curl --http2` sends it): one a request,
  on any connection, which is served as HTTP/1.1 all the same (counted as any request).
- a request past the connection cap ("Exceeded concurrency limit."): the protocol refuses
  most there itself, silently (`api/shedding_protocol.py`), but an upgrade and a request
  pipelined behind an unanswered one go through uvicorn's own check, which logs one a
  request of a flood. Its refusal is counted in `steadyserve_rejected_total{reason=
  "connections"}`.

A client repeating any of them as fast as it sends wrote the log full, at the cost of the
event loop's time. `ClientWarnings`, a filter on that logger (`quiet_client_warnings`,
which a front end installs with its uvicorn configuration, `cli.uvicorn_config`), drops
them and says instead, at most once per `SUMMARY_INTERVAL_S`, how many of each it dropped
since it last said so. Event loop thread (where uvicorn logs them).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

from app.log_limits import Throttle

log = logging.getLogger(__name__)

UVICORN_LOGGER = "uvicorn.error"
# uvicorn's own words (uvicorn/protocols/http/httptools_impl.py), by what each says.
CLIENT_WARNINGS = {
    "Invalid HTTP request received.": "invalid_http",
    "Unsupported upgrade request.": "unsupported_upgrade",
    "Exceeded concurrency limit.": "connection_cap",
}
# What uvicorn adds to an unsupported upgrade's warning when no WebSocket library is
# installed (the image has one): dropped with it, not counted twice.
_NO_WEBSOCKETS = "No supported WebSocket library detected."
SUMMARY_INTERVAL_S = 60.0


class ClientWarnings(logging.Filter):
    """Drops `CLIENT_WARNINGS` from the logger it filters, counting them for one summary
    line (on this module's logger) at most every `SUMMARY_INTERVAL_S`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self._summaries = Throttle(SUMMARY_INTERVAL_S, clock)
        self._dropped: Counter[str] = Counter()

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg
        if not isinstance(message, str):
            return True
        kind = CLIENT_WARNINGS.get(message)
        if kind is None:
            return not message.startswith(_NO_WEBSOCKETS)
        self._dropped[kind] += 1
        if self._summaries.allow():
            said = ", ".join(f"{count} {name}" for name, count in sorted(self._dropped.items()))
            self._dropped.clear()
            log.info(
                "uvicorn warnings caused by clients, dropped since the last such line (one "
                "every %g s at most): %s",
                SUMMARY_INTERVAL_S,
                said,
            )
        return False


def quiet_client_warnings(clock: Callable[[], float] = time.monotonic) -> ClientWarnings:
    """Install `ClientWarnings` on uvicorn's logger, in place of any installed before."""
    logger = logging.getLogger(UVICORN_LOGGER)
    for installed in [f for f in logger.filters if isinstance(f, ClientWarnings)]:
        logger.removeFilter(installed)
    quiet = ClientWarnings(clock)
    logger.addFilter(quiet)
    return quiet
