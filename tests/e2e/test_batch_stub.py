"""`steadyserve batch` and `BatchClient` against a seeded misbehaving stub on 127.0.0.1.

The stub (tests/support/flaky_server.py) answers 429 with Retry-After, 503, resets
connections and stalls at random; the point here is the client's behaviour, not vectors
(those are checked against the real server in test_batch_server.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from app.batchclient import (
    BatchClient,
    ClientOptions,
    Failure,
    Item,
    RetryPolicy,
    Success,
    SyncBatchClient,
)
from tests.support.batch import (
    assert_each_id_exactly_once,
    batch_command,
    killed_on_exit,
    read_lines,
    run_batch,
    write_input,
)
from tests.support.flaky_server import (
    MARKER_INVALID,
    MARKER_NAN,
    Misbehaviour,
    running_flaky_server,
)
from tests.support.server import REPO_ROOT

pytestmark = pytest.mark.e2e

FAULTS = Misbehaviour(
    seed=11,
    reset=0.03,
    throttle=0.08,
    unavailable=0.03,
    server_error=0.03,
    stall=0.02,
    stall_s=0.6,
    retry_after="0",  # keeps the test short; honouring the value is tested below
)


def _lines(count: int, invalid_every: int = 0) -> list[dict[str, object]]:
    lines: list[dict[str, object]] = []
    for i in range(count):
        text = f"sentence {i}"
        if invalid_every and i % invalid_every == 3:
            text += f" {MARKER_INVALID}"
        lines.append({"id": f"doc-{i}", "inputs": text})
    return lines


@pytest.mark.parametrize("inputs_per_request", ["1", "8"])
def test_every_id_lands_exactly_once_despite_faults(
    tmp_path: Path, inputs_per_request: str
) -> None:
    lines = _lines(1200, invalid_every=100)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, lines)
    with running_flaky_server(FAULTS) as server:
        done = run_batch(
            source,
            f"http://127.0.0.1:{server.port}",
            out,
            "--timeout-ms",
            "300",
            "--max-retries",
            "30",
            "--seed",
            "1",
            "--inputs-per-request",
            inputs_per_request,
        )
    assert done.returncode == 3, done.stderr  # done, with the invalid lines in errors
    answered, failed = assert_each_id_exactly_once(
        [line["id"] for line in lines], out, tmp_path / "out.errors.jsonl"
    )
    assert {f["id"] for f in failed} == {f"doc-{i}" for i in range(3, 1200, 100)}
    assert all(f["status"] == 422 and f["error"]["param"] == "inputs[0]" for f in failed)
    assert all(len(a["outputs"]) == 1 for a in answered)
    # The faults really happened, and the client got through them.
    assert server.resets > 0 and server.answered.get(429, 0) > 0
    assert server.answered.get(503, 0) > 0 and server.answered.get(500, 0) > 0
    assert "timeouts" in done.stderr and "batch summary" in done.stderr


def test_a_422_line_goes_to_errors_without_retries(tmp_path: Path) -> None:
    lines = _lines(50, invalid_every=10)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, lines)
    with running_flaky_server(Misbehaviour()) as server:
        done = run_batch(source, f"http://127.0.0.1:{server.port}", out)
        invalid_texts = [t for t in server.inputs_seen if MARKER_INVALID in t]
        sent = {t: len(server.inputs_seen[t]) for t in invalid_texts}
        # A rerun sends nothing (every id is done) and still says lines are in errors.
        requests = sum(len(arrivals) for arrivals in server.inputs_seen.values())
        rerun = run_batch(source, f"http://127.0.0.1:{server.port}", out)
        assert sum(len(arrivals) for arrivals in server.inputs_seen.values()) == requests
    assert rerun.returncode == 3, rerun.stderr
    assert "lines_in_errors_file  5" in rerun.stderr
    assert done.returncode == 3
    assert len(sent) == 5 and set(sent.values()) == {1}, sent
    failed = read_lines(tmp_path / "out.errors.jsonl")
    assert len(failed) == 5
    assert all(f["attempts"] == 1 and not f["retryable"] for f in failed)
    assert all(f["error"] == {"type": "invalid_request", "message": "invalid input",
                              "param": "inputs[0]", "code": "invalid_request"}
               for f in failed)  # fmt: skip
    assert len(read_lines(out)) == 45


def test_a_pack_that_fails_every_try_with_a_500_is_resent_line_by_line(tmp_path: Path) -> None:
    """One input the model computes NaN for made its whole pack fail (500 on every try):
    the pack's other lines went to errors too, though each alone succeeds."""
    lines = [{"id": f"doc-{i}", "inputs": f"sentence {i}"} for i in range(4)]
    lines[1]["inputs"] = f"sentence 1 {MARKER_NAN}"
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, lines)
    with running_flaky_server(Misbehaviour()) as server:
        done = run_batch(
            source, f"http://127.0.0.1:{server.port}", out,
            "--inputs-per-request", "4", "--max-retries", "1",
        )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert sorted(r["id"] for r in read_lines(out)) == ["doc-0", "doc-2", "doc-3"]
    failed = read_lines(tmp_path / "out.errors.jsonl")
    assert [(f["id"], f["status"]) for f in failed] == [("doc-1", 500)]


def test_429_and_503_wait_for_retry_after(tmp_path: Path) -> None:
    behaviour = Misbehaviour(seed=5, throttle=0.25, unavailable=0.15, retry_after="1")
    items = [Item(i, {"inputs": f"text {i}"}) for i in range(30)]

    async def run() -> list[Success]:
        async with BatchClient(url, ClientOptions(concurrency=8, seed=2)) as client:
            return [r async for r in client.infer_many(items) if isinstance(r, Success)]

    with running_flaky_server(behaviour) as server:
        url = f"http://127.0.0.1:{server.port}"
        results = asyncio.run(run())
    assert len(results) == 30
    gaps = [
        later - earlier
        for arrivals in server.inputs_seen.values()
        for earlier, later in itertools.pairwise(arrivals)
    ]
    assert len(gaps) >= 5  # several items were refused at least once
    # Retry-After: 1 is a floor (the jitter's ceiling is the unit test's to check: a retry
    # may arrive late on a busy machine for reasons of its own).
    assert min(gaps) >= 1.0


def test_the_client_never_exceeds_its_rate(tmp_path: Path) -> None:
    rate = 100.0
    items = [Item(i, {"inputs": f"text {i}"}) for i in range(250)]

    async def run() -> int:
        async with BatchClient(url, ClientOptions(concurrency=64, rate=rate)) as client:
            return sum([1 async for r in client.infer_many(items) if isinstance(r, Success)])

    with running_flaky_server(Misbehaviour(delay_s=0.001)) as server:
        url = f"http://127.0.0.1:{server.port}"
        assert asyncio.run(run()) == 250
        arrivals = sorted(server.arrivals)
    # The whole run cannot be faster than the rate (unlimited, 250 requests take a fraction
    # of the 2.5 s). At most rate + 1 in any one second is checked on the client's own send
    # times in virtual time (tests/unit/test_batch_rate.py): the stub records an arrival
    # after reading the body, on a thread sharing the GIL with the client, so a 10 ms delay
    # could put 102 arrivals in one second of a client that sent 101.
    assert arrivals[-1] - arrivals[0] >= (len(arrivals) - 1) / rate * 0.95


def test_concurrency_falls_under_429s_and_recovers_after() -> None:
    # The stub takes at most 4 requests in flight (429 beyond, as steadyserve's in-flight
    # cap does) for its first 400 requests, then any number.
    behaviour = Misbehaviour(delay_s=0.01, capacity=4, capacity_after=400, retry_after="0")
    items = [Item(i, {"inputs": f"text {i}"}) for i in range(2500)]
    trace: list[int] = []
    started_at: list[int] = []  # the window the client starts with, from the client itself

    async def run() -> ClientOptions:
        options = ClientOptions(concurrency=64, retry=RetryPolicy(max_retries=50))
        async with BatchClient(url, options) as client:
            started_at.append(client.stats().concurrency)
            async for result in client.infer_many(items):
                assert isinstance(result, Success)
                trace.append(client.stats().concurrency)
        return options

    with running_flaky_server(behaviour) as server:
        url = f"http://127.0.0.1:{server.port}"
        asyncio.run(run())
        max_in_flight_after = server.max_in_flight_after_capacity
    assert len(trace) == 2500
    low_point = trace.index(min(trace))
    capacity, (start,) = behaviour.capacity, started_at
    assert capacity is not None
    assert start > capacity  # it starts above what the stub takes, so it has to fall
    assert min(trace) <= capacity  # and it fell under the 429s
    assert max(trace[low_point:]) >= 16  # and recovered once they stopped
    assert max_in_flight_after >= 12  # the server really saw the larger window


def test_sigkill_then_restart_ends_with_every_id_once(tmp_path: Path) -> None:
    lines = _lines(3000)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, lines)
    with running_flaky_server(Misbehaviour(delay_s=0.005)) as server:
        url = f"http://127.0.0.1:{server.port}"
        first = subprocess.Popen(
            batch_command(source, url, out, "--concurrency", "16"),
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        with killed_on_exit(first):
            give_up_at = time.monotonic() + 60
            while len(out.read_bytes().splitlines()) < 300 if out.exists() else True:
                assert first.poll() is None and time.monotonic() < give_up_at
                time.sleep(0.02)  # polling interval: the loop checks the file itself
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
        # What a kill in the middle of a write leaves: a last line without its newline.
        with out.open("ab") as file:
            file.write(b'{"id":"doc-2999","model":"stub","outp')
        done_before = {line["id"] for line in read_lines_whole(out)}
        restarted_at = time.monotonic()
        second = run_batch(source, url, out)
        resent = [
            text
            for text, arrivals in server.inputs_seen.items()
            if f"doc-{text.split()[1]}" in done_before and arrivals[-1] >= restarted_at
        ]
    assert second.returncode == 0, second.stderr
    assert "cut a torn last line" in second.stderr
    assert f"resuming: {len(done_before):,} ids" in second.stderr
    assert resent == []  # nothing already written was asked for again
    assert_each_id_exactly_once([line["id"] for line in lines], out, tmp_path / "out.errors.jsonl")


def read_lines_whole(path: Path) -> list[dict[str, object]]:
    """The whole lines of a journal (those with their newline)."""
    data = path.read_bytes()
    return [orjson.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines()]


def test_sigterm_finishes_what_is_in_flight_and_exits_non_zero(tmp_path: Path) -> None:
    lines = _lines(400)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, lines)
    summary_path = tmp_path / "summary.json"
    with running_flaky_server(Misbehaviour(delay_s=0.2)) as server:
        url = f"http://127.0.0.1:{server.port}"
        job = subprocess.Popen(
            batch_command(
                source, url, out, "--concurrency", "8", "--summary-json", str(summary_path)
            ),
            cwd=REPO_ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        with killed_on_exit(job):
            give_up_at = time.monotonic() + 60
            while len(read_lines(out)) < 10 if out.exists() else True:
                assert job.poll() is None and time.monotonic() < give_up_at
                time.sleep(0.02)  # polling interval: the loop checks the file itself
            job.send_signal(signal.SIGTERM)
            _, stderr = job.communicate(timeout=30)
        answered_by_server = server.answered.get(200, 0)
    assert job.returncode == 128 + signal.SIGTERM, stderr
    assert "batch summary" in stderr
    written = read_lines(out)
    # Every request the server answered was written: nothing in flight was dropped.
    assert len(written) == answered_by_server
    assert len(written) < len(lines)
    document = orjson.loads(summary_path.read_bytes())
    assert document["stopped_by"] == "SIGTERM" and document["complete"] is False
    assert document["lines_ok"] == len(written)
    assert document["lines_ok"] + document["lines_unfinished"] == len(lines)


def test_sync_client_yields_answers_and_failures() -> None:
    items = [Item(i, {"inputs": f"text {i}"}) for i in range(20)]
    items.append(Item("bad", {"inputs": f"text {MARKER_INVALID}"}))
    with running_flaky_server(Misbehaviour(seed=3, throttle=0.2, retry_after="0")) as server:
        client = SyncBatchClient(f"http://127.0.0.1:{server.port}", ClientOptions(seed=1))
        results = list(client.infer_many(items))
    answered = {r.id for r in results if isinstance(r, Success)}
    failed = [r for r in results if isinstance(r, Failure)]
    assert answered == set(range(20))
    assert [(f.id, f.status, f.retryable) for f in failed] == [("bad", 422, False)]
    assert client.last_stats is not None and client.last_stats.throttled > 0


def test_a_failing_item_source_stops_the_run_and_is_raised() -> None:
    def items() -> Iterator[Item]:
        yield Item(1, {"inputs": "a"})
        yield Item(2, {"inputs": "b"})
        raise OSError("input vanished")

    async def run() -> tuple[list[object], int]:
        seen: list[object] = []
        async with BatchClient(url) as client:
            with pytest.raises(OSError, match="input vanished"):
                async for result in client.infer_many(items()):
                    assert isinstance(result, Success)
                    seen.append(result.id)
            return seen, client.stats().lines_unfinished

    with running_flaky_server(Misbehaviour()) as server:
        url = f"http://127.0.0.1:{server.port}"
        seen, unfinished = asyncio.run(run())
    # As on SIGTERM: what was sent is answered, the rest is left unfinished, none lost.
    assert len(seen) + unfinished == 2


def test_leaving_the_loop_early_ends_every_request() -> None:
    items = [Item(i, {"inputs": f"text {i}"}) for i in range(500)]

    async def run() -> int:
        before = asyncio.all_tasks()
        async with BatchClient(url, ClientOptions(concurrency=16)) as client:
            taken = 0
            async with contextlib.aclosing(client.infer_many(items)) as results:
                async for _ in results:
                    taken += 1
                    if taken == 20:
                        # Until the server has answered a full queue's worth (2 x 16) more,
                        # so that some tasks wait to hand theirs over; leaving the block
                        # closes the generator: nothing may be left.
                        give_up_at = time.monotonic() + 5
                        while len(server.inputs_seen) < taken + 2 * 16:
                            assert time.monotonic() < give_up_at, "the queue never filled"
                            await asyncio.sleep(0.001)  # the server answers meanwhile
                        break
            return len(asyncio.all_tasks() - before)

    with running_flaky_server(Misbehaviour(delay_s=0.01)) as server:
        url = f"http://127.0.0.1:{server.port}"
        assert asyncio.run(asyncio.wait_for(run(), 10)) == 0


def test_header_option_is_sent_with_every_request(tmp_path: Path) -> None:
    lines = _lines(30)
    source = tmp_path / "in.jsonl"
    write_input(source, lines)
    behaviour = Misbehaviour(required_header=b"authorization: Bearer s3cret")
    with running_flaky_server(behaviour) as server:
        url = f"http://127.0.0.1:{server.port}"
        with_token = run_batch(
            source, url, tmp_path / "a.jsonl", "--header", "Authorization: Bearer s3cret"
        )
    assert with_token.returncode == 0, with_token.stderr
    assert len(read_lines(tmp_path / "a.jsonl")) == 30


def test_a_401_stops_the_run_and_a_rerun_with_the_token_does_every_line(tmp_path: Path) -> None:
    """A 401 is about the client, not a line: it sent the whole input to the errors file,
    which a rerun then skipped, so fixing the token could not get a single line done."""
    lines = _lines(300)
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_input(source, lines)
    behaviour = Misbehaviour(required_header=b"authorization: Bearer s3cret")
    with running_flaky_server(behaviour) as server:
        url = f"http://127.0.0.1:{server.port}"
        refused = run_batch(source, url, out, "--concurrency", "4")
        assert refused.returncode == 1, refused.stderr
        assert "HTTP 401" in refused.stderr
        assert read_lines(tmp_path / "out.errors.jsonl") == []
        # Stopped at once: only what was in flight (--concurrency 4) was sent.
        assert 1 <= server.unauthorized <= 4
        rerun = run_batch(source, url, out, "--header", "Authorization: Bearer s3cret")
    assert rerun.returncode == 0, rerun.stderr
    assert_each_id_exactly_once([line["id"] for line in lines], out, tmp_path / "out.errors.jsonl")
