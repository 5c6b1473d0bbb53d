"""What the front end <-> engine transport costs: round trips of real protocol messages
(`Submit` with one 15-token input, `Output` with one 384-float vector, msgpack via msgspec)
over ZeroMQ `ipc://` (DEALER <-> ROUTER, as `app/engine` uses it), between two processes, one
request in flight and 64 in flight. Reported per message pair, to set against a front end's
few hundred microseconds per request: the share shared memory could save at best.

    python -m loadtest.transport_bench --seconds 5
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zmq

from app.engine.protocol import (
    EmbedOutput,
    EmbedPayload,
    Output,
    Submit,
    decode_from_engine,
    decode_to_engine,
    encode,
)

TOKENS = [101, 1996, 4248, 2829, 4419, 14523, 2058, 1996, 13971, 3899, 2096, 1037, 2235, 4743, 102]
WIDTH = 384


def _engine(address: str) -> None:
    """Echo an `Output` for every `Submit` (decode and encode both ways, as the engine)."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.bind(address)
    vector = np.zeros((1, WIDTH), dtype=np.float32).tobytes()
    while True:
        origin, data = router.recv_multipart()
        message = decode_to_engine(data)
        if not isinstance(message, Submit):
            break
        output = Output(message.request_id, True, EmbedOutput(vector, 1, WIDTH, 15), 0.0, 0.0)
        router.send_multipart([origin, encode(output)])


def measure(address: str, in_flight: int, seconds: float) -> float:
    """Microseconds of wall time per request/response pair."""
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(address)
    sent = done = 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds or done < sent:
        while sent - done < in_flight and time.perf_counter() - started < seconds:
            sent += 1
            dealer.send(encode(Submit(sent, "m", 0.0, EmbedPayload([TOKENS]))))
        output = decode_from_engine(dealer.recv())
        np.frombuffer(output.payload.vectors, dtype=np.float32)  # type: ignore[union-attr]
        done += 1
    elapsed = time.perf_counter() - started
    dealer.close(linger=0)
    context.term()
    return 1e6 * elapsed / done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.transport_bench")
    parser.add_argument("--seconds", type=float, default=5.0)
    options = parser.parse_args(argv)
    address = f"ipc://{Path(tempfile.mkdtemp()) / 'bench.sock'}"
    engine = multiprocessing.get_context("spawn").Process(target=_engine, args=(address,))
    engine.start()
    try:
        rows = ["| requests in flight | wall time per request/response pair |", "|---:|---:|"]
        for in_flight in (1, 64):
            rows.append(f"| {in_flight} | {measure(address, in_flight, options.seconds):.1f} us |")
        print("\n".join(rows))
    finally:
        engine.kill()
        engine.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
