"""``steadyserve batch INPUT.jsonl --url http://HOST:PORT --out OUTPUT.jsonl``.

Every input line ends up exactly once in OUTPUT (answered) or OUTPUT.errors.jsonl
(refused by the server with a 4xx other than 429, out of retries, or not a request at
all). A 401 or 407 is about the client, not a line: the run stops, the lines not
answered stay out of both files, and the job exits 1. Restarted with the same arguments
it skips the ids already in either file, so a killed job resumes where it stopped.
SIGINT/SIGTERM: stop sending, write what is in flight, print the summary, exit 128 +
signal (a second signal drops what is in flight, still writing every answer received;
later ones are ignored, the summary written all the same). With --retry-errors the lines
whose request failed in an earlier run are sent again, their failure records removed
first.

Exit status: 0 every line answered; 3 done, but some lines are in the errors file;
128 + N stopped by signal N (run again to resume); 1 the job could not run (the server
refused the client's credentials included: run again with the right --header); 2 usage.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import orjson

from app.batchclient.client import BatchClient, ClientRefused
from app.batchclient.interrupts import Interrupts
from app.batchclient.items import Failure, InvalidLine, Item, ItemId, Success
from app.batchclient.journal import (
    DUPLICATE_ID,
    INVALID_LINE,
    CorruptJournal,
    IdSet,
    Journal,
    RefusedLines,
    drop_failures,
    errors_path_for,
    failed_lines_of,
    line_digest,
    read_ids,
    repair_torn_tail,
)
from app.batchclient.options import ClientOptions
from app.batchclient.progress import JobProgress, ProgressDisplay, summary, summary_table
from app.batchclient.retry import RetryPolicy
from loadtest.httpclient import Target

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_SOME_ERRORS = 3
TICK_S = 0.5


def _at_least(least: float, kind: type[int] | type[float]) -> Callable[[str], float]:
    """An argparse type: a number of `kind` no smaller than `least` (a usage error, exit 2,
    otherwise)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < least:
            raise argparse.ArgumentTypeError(f"{text} is under {least:g}")
        return value

    return parse


_POSITIVE_INT = _at_least(1, int)
_POSITIVE = _at_least(1e-9, float)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="steadyserve batch",
        description="Push a JSONL file through /infer at the server's pace; resumable.",
    )
    parser.add_argument("input", type=Path, help="JSONL: one /infer body (+ optional id) a line")
    parser.add_argument("--url", required=True, help="server or Envoy base URL, e.g. http://h:8000")
    parser.add_argument("--out", required=True, type=Path, help="OUTPUT.jsonl (appended to)")
    parser.add_argument(
        "--concurrency",
        type=_POSITIVE_INT,
        default=128,
        help="most requests in flight; the client adapts between 1 and this (default 128)",
    )
    parser.add_argument(
        "--fixed-concurrency",
        action="store_true",
        help="keep --concurrency in flight instead of adapting (for comparisons)",
    )
    parser.add_argument("--rate", type=_POSITIVE, help="most requests per second, retries included")
    parser.add_argument(
        "--inputs-per-request",
        type=_POSITIVE_INT,
        default=1,
        help="pack up to N inputs per request",
    )
    parser.add_argument(
        "--timeout-ms", type=_POSITIVE, default=30000.0, help="per attempt (default 30000)"
    )
    parser.add_argument(
        "--max-retries",
        type=_at_least(0, int),
        default=8,
        help="retries of one request (default 8)",
    )
    parser.add_argument(
        "--max-deadline-retries",
        type=_at_least(0, int),
        default=2,
        help="of those, retries after a 504: a request answered 504 once more fails, "
        "as one that does not fit its deadline (default 2)",
    )
    parser.add_argument(
        "--max-engine-lost-retries",
        type=_at_least(0, int),
        default=2,
        help="of those, retries after a 503 engine_lost: a request answered it once more "
        "fails, as one that may be what kills the engine (default 2)",
    )
    parser.add_argument(
        "--header",
        action="append",
        default=[],
        metavar="'NAME: VALUE'",
        help="extra request header, e.g. 'Authorization: Bearer T' (repeatable)",
    )
    parser.add_argument(
        "--retry-errors",
        action="store_true",
        help="also send again the lines an earlier run recorded as failed in the errors "
        "file (their records are replaced; invalid and duplicate lines stay)",
    )
    parser.add_argument("--summary-json", type=Path, help="write the final summary here")
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "lines", "off"),
        default="auto",
        help="bar on a terminal, periodic lines otherwise (auto)",
    )
    parser.add_argument(
        "--progress-interval",
        type=_POSITIVE,
        default=10.0,
        help="seconds between progress lines",
    )
    parser.add_argument("--seed", type=int, help="seed of the retry jitter")
    return parser


def parse_headers(values: list[str]) -> dict[str, str]:
    headers: dict[str, str] = {}
    for value in values:
        name, sep, content = value.partition(":")
        if not sep or not name.strip() or "\r" in value or "\n" in value:
            raise ValueError(f"--header {value!r} is not 'NAME: VALUE' on one line")
        try:
            value.encode("latin-1")  # what HTTP/1.1 headers carry
        except UnicodeEncodeError:
            raise ValueError(f"--header {value!r} holds characters outside latin-1") from None
        headers[name.strip()] = content.strip()
    return headers


def peak_resident_mb() -> float | None:
    """This process's peak resident memory, from VmHWM: counted since its exec, unlike
    getrusage's ru_maxrss, which Linux carries over from the parent across fork and exec.
    None where /proc is not Linux's."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024.0, 1)
    except (OSError, ValueError, IndexError):
        return None
    return None


def count_lines(path: Path) -> int:
    """Non-blank lines (the total for the bar and the ETA), read as a stream."""
    count = 0
    with path.open("rb") as file:
        for line in file:
            if line.strip():
                count += 1
    return count


@dataclass
class _Source:
    """Reads INPUT lazily. A line whose id an earlier line has is a `duplicate_id` error, an
    invalid line an `invalid_line` one, both recorded at once by their line number (their
    id is not theirs: an invalid line has none, a duplicate's is the earlier line's); a line
    a previous run answered (its id in `resumed`) or refused (its number and content in
    `refused_lines`) is skipped. So every line ends up once in OUTPUT or errors, across
    runs too, none skipped silently. (A line without an id has its line number: explicit
    integer ids and id-less lines can collide, and then the later line is a duplicate.)"""

    path: Path
    resumed: IdSet  # marked as this run's lines have them (`IdSet.mark`)
    errors: Journal
    refused_lines: RefusedLines = field(default_factory=RefusedLines)
    failed_before: IdSet = field(default_factory=IdSet)  # ids in the errors file
    skipped: int = 0
    # Of those skipped, the lines whose record is in the errors file: still not answered.
    skipped_as_failed: int = 0
    invalid: int = 0

    def items(self) -> Iterator[Item]:
        with self.path.open("rb") as file:
            for line_number, line in enumerate(file, start=1):
                if not line.strip():
                    continue
                if self.refused_lines.refused(line_number, line):  # by a previous run
                    self.skipped += 1
                    self.skipped_as_failed += 1
                    continue
                try:
                    item = Item.from_line(line, line_number)
                except InvalidLine as error:
                    self._refuse(line_number, line_number, line, INVALID_LINE, str(error))
                    continue
                # Marked even when a previous run answered it: a later line with the same id
                # is still a duplicate (skipped as answered, it was silently lost).
                answered_before, earlier_line = self.resumed.mark(item.id)
                if earlier_line:
                    message = f"line {line_number}: id {item.id!r} is already an earlier line's"
                    self._refuse(item.id, line_number, line, DUPLICATE_ID, message)
                elif answered_before:
                    self.skipped += 1
                    self.skipped_as_failed += item.id in self.failed_before
                else:
                    yield item

    def _refuse(
        self, item_id: ItemId, line_number: int, line: bytes, kind: str, message: str
    ) -> None:
        self.invalid += 1
        failure = Failure(
            item_id,
            None,
            {"type": kind, "message": message},
            attempts=0,
            retryable=False,
            line=line_number,
            line_digest=line_digest(line),
        )
        self.errors.append([failure.json_line()])


async def run_job(args: argparse.Namespace, stream: TextIO) -> int:
    output: Path = args.out
    errors_path = errors_path_for(output)
    for path in (output, errors_path):
        torn = repair_torn_tail(path)
        if torn:
            stream.write(f"batch: {path}: cut a torn last line ({torn} bytes); it is redone\n")
    if args.retry_errors:
        retried = drop_failures(errors_path, failed_lines_of(args.input, errors_path))
        stream.write(f"batch: --retry-errors: {retried:,} failed lines are sent again\n")
    done = IdSet()
    refused_lines = RefusedLines()
    failed_before = IdSet()
    resumed = read_ids(errors_path, done, refused_lines, failed_before) + read_ids(output, done)
    if resumed:
        stream.write(f"batch: resuming: {resumed:,} ids already in {output} or its errors\n")
    total = count_lines(args.input)
    options = ClientOptions(
        concurrency=args.concurrency,
        adaptive=not args.fixed_concurrency,
        rate=args.rate,
        inputs_per_request=args.inputs_per_request,
        timeout_s=args.timeout_ms / 1000.0,
        retry=RetryPolicy(
            max_retries=args.max_retries,
            max_deadline_retries=args.max_deadline_retries,
            max_engine_lost_retries=args.max_engine_lost_retries,
        ),
        headers=parse_headers(args.header),
        seed=args.seed,
    )
    mode = args.progress
    if mode == "auto":
        mode = "bar" if stream.isatty() else "lines"
    display = ProgressDisplay(stream, mode, args.progress_interval)
    results_journal = Journal(output)
    errors_journal = Journal(errors_path)
    source = _Source(args.input, done, errors_journal, refused_lines, failed_before)
    started = time.monotonic()
    refused: list[ClientRefused] = []
    client = BatchClient(args.url, options)
    interrupts = Interrupts(client, stream)

    def progress() -> JobProgress:
        return JobProgress(
            total, source.skipped, source.invalid, time.monotonic() - started, client.stats()
        )

    async def show() -> None:
        while True:
            display.tick(progress())
            await asyncio.sleep(TICK_S)

    # Until the summary is written: a signal after the last answer is ignored, not fatal.
    with interrupts.installed(asyncio.get_running_loop()):
        async with client:
            ticker = asyncio.create_task(show())
            try:
                async for result in client.infer_many(source.items()):
                    if isinstance(result, Success):
                        results_journal.append([result.json_line()])
                    else:
                        errors_journal.append([result.json_line()])
            except ClientRefused as error:
                refused.append(error)
            finally:
                ticker.cancel()
                results_journal.close()
                errors_journal.close()
        final = progress()
        display.close(final)
        stopped_by = interrupts.first
        document = summary(final, stopped_by.name if stopped_by is not None else None)
        document["peak_resident_mb"] = peak_resident_mb()
        # A rerun skips the lines earlier runs put in the errors file: those are still not
        # answered, and the exit status says so. A record of a line since fixed (read again
        # and answered) is not one of them.
        document["lines_in_errors_file"] = source.skipped_as_failed + errors_journal.lines_written
        stream.write("batch summary:\n" + summary_table(document) + "\n")
        if args.summary_json is not None:
            args.summary_json.write_bytes(orjson.dumps(document, option=orjson.OPT_INDENT_2))
    if refused:
        stream.write(f"batch: {refused[0]}; fix --header and run again to resume\n")
        return EXIT_FAILED
    if stopped_by is not None:
        return 128 + int(stopped_by)
    if document["lines_in_errors_file"] or document["lines_unfinished"]:
        return EXIT_SOME_ERRORS
    return EXIT_OK


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line `main` runs; SystemExit (status 2) on a usage error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parse_headers(args.header)
        # Checked here, as the client would build them: found only when the run starts,
        # a bad URL or header was exit 1 ("could not run"), not the usage error it is.
        Target.parse(BatchClient.infer_url_for(args.url))
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: list[str] | None = None, stream: TextIO | None = None) -> int:
    args = parse_arguments(argv)
    out = stream or sys.stderr
    try:
        if not args.input.is_file():
            raise ValueError(f"{args.input} is not a file")
        return asyncio.run(run_job(args, out))
    except (ValueError, CorruptJournal, OSError) as error:
        out.write(f"batch: {error}\n")
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
