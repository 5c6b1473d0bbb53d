"""A closed-loop HTTP/1.1 flood on 127.0.0.1, as naive orchestrator retry loops send it.

Each of `connections` clients keeps one connection open and sends the next POST the moment
it has an answer, a 429 included (no back-off: the worst case a server must survive). It
stops by itself after `duration_s`. Raw asyncio streams rather than an HTTP library, so the
client costs little CPU next to the server on a small machine and so every way a response
can fail to arrive is seen as what it is: a reset, or a connection closed before an answer.

`flood` runs the clients in a child process (one uvloop event loop, so at most one core) at
a lower scheduling priority: the load generator stands in for clients on other machines, so
on a small shared machine it yields the CPU to the server under test instead of taking it.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import uvloop


@dataclass
class FloodResult:
    duration_s: float
    statuses: Counter[int] = field(default_factory=Counter)
    # Responses that could not be read, by kind: "reset" (ECONNRESET / broken pipe),
    # "closed" (EOF before a whole response), "timeout", "connect" (could not connect).
    failures: Counter[str] = field(default_factory=Counter)
    # 429s that came without a Retry-After header.
    missing_retry_after: int = 0
    # Distinct bodies of the 429s (the same few prebuilt answers, whatever the count).
    rejection_bodies: set[bytes] = field(default_factory=set)
    # 2xx answers that arrived within the sending window (the goodput's numerator).
    ok_in_window: int = 0
    # Answers that came with `connection: close` (the client had to reconnect).
    closed_after_answer: int = 0
    # Seconds from sending to the whole answer, by status (for reports, never asserted on).
    latencies_s: dict[int, list[float]] = field(default_factory=dict)

    def latency_ms(self, status: int, quantile: float) -> float | None:
        samples = sorted(self.latencies_s.get(status, ()))
        if not samples:
            return None
        return 1000 * samples[min(len(samples) - 1, int(quantile * len(samples)))]

    def summary(self) -> str:
        """One line for logs and docs/BENCHMARKS.md."""
        parts = [f"2xx {self.ok_per_s:.0f}/s", f"statuses {dict(self.statuses)}"]
        for status in sorted(self.latencies_s):
            p50, p99 = self.latency_ms(status, 0.5), self.latency_ms(status, 0.99)
            parts.append(f"{status} p50 {p50:.1f} ms p99 {p99:.1f} ms")
        parts.append(f"failures {dict(self.failures)}")
        parts.append(f"closed after answer {self.closed_after_answer}")
        return ", ".join(parts)

    @property
    def ok_per_s(self) -> float:
        return self.ok_in_window / self.duration_s

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if status >= 500)


def _request(port: int, path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, dict[bytes, bytes], bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status_line, *header_lines = head[:-4].split(b"\r\n")
    status = int(status_line.split(b" ", 2)[1])
    headers: dict[bytes, bytes] = {}
    for line in header_lines:
        name, _, value = line.partition(b":")
        headers[name.strip().lower()] = value.strip()
    if b"content-length" not in headers:
        raise ValueError(f"response {status} without content-length: {headers!r}")
    payload = await reader.readexactly(int(headers[b"content-length"]))
    return status, headers, payload


async def _client(
    port: int,
    request: bytes,
    stop_at: float,
    result: FloodResult,
    timeout_s: float,
) -> None:
    writer: asyncio.StreamWriter | None = None
    reader: asyncio.StreamReader | None = None
    try:
        while time.monotonic() < stop_at:
            if writer is None or reader is None:
                try:
                    reader, writer = await asyncio.wait_for(
                        asyncio.open_connection("127.0.0.1", port), timeout_s
                    )
                except (OSError, TimeoutError):
                    result.failures["connect"] += 1
                    return  # a server that refuses connections: counted once, no spinning
            sent_at = time.monotonic()
            try:
                writer.write(request)
                status, headers, payload = await asyncio.wait_for(_read_response(reader), timeout_s)
            except (ConnectionResetError, BrokenPipeError):
                result.failures["reset"] += 1
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                result.failures["closed"] += 1
            except TimeoutError:
                result.failures["timeout"] += 1
            else:
                result.statuses[status] += 1
                result.latencies_s.setdefault(status, []).append(time.monotonic() - sent_at)
                if 200 <= status < 300 and time.monotonic() <= stop_at:
                    result.ok_in_window += 1
                if status == 429:
                    if b"retry-after" not in headers:
                        result.missing_retry_after += 1
                    result.rejection_bodies.add(payload)
                if headers.get(b"connection", b"").lower() != b"close":
                    continue
                result.closed_after_answer += 1
            # Anything but a kept-alive answer: start again on a fresh connection.
            writer.close()
            writer = reader = None
    finally:
        if writer is not None:
            writer.close()


# Niceness of the flooding process (the server's front ends run at +5, its engine at 0).
CLIENT_NICENESS = 10


def _run_clients(
    port: int, connections: int, duration_s: float, body: bytes, path: str, timeout_s: float
) -> FloodResult:
    """The flood itself; runs in the child process."""
    os.nice(CLIENT_NICENESS)

    async def run() -> FloodResult:
        result = FloodResult(duration_s=duration_s)
        stop_at = time.monotonic() + duration_s
        request = _request(port, path, body)
        await asyncio.gather(
            *(_client(port, request, stop_at, result, timeout_s) for _ in range(connections))
        )
        return result

    # uvloop: the client's CPU per request is what the server loses on a small machine.
    return uvloop.run(run())


def flood(
    port: int,
    connections: int,
    duration_s: float,
    body: bytes,
    path: str = "/infer",
    timeout_s: float = 15.0,
) -> FloodResult:
    """`connections` closed-loop clients against 127.0.0.1:`port` for `duration_s` seconds.

    Requests still unanswered at the end are awaited (at most `timeout_s`), so every request
    sent is accounted for; `duration_s` is the sending window the throughput is divided by.
    Blocks the calling thread until the child process has finished (bounded by both limits).
    """
    context = multiprocessing.get_context("forkserver")
    with context.Pool(processes=1) as pool:
        return pool.apply(_run_clients, (port, connections, duration_s, body, path, timeout_s))
