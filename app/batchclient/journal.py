"""The output and errors files as a journal: append-only JSONL, one line per finished id.

A line is written with one ``write`` of the whole line, newline last, and flushed to the
operating system at once, so a client killed at any moment (SIGKILL included) leaves every
line whole except possibly the last, which then lacks its newline. ``repair_torn_tail``
cuts such a line off; its id is then not done and is sent again on restart. Flushing to
the OS survives the death of the process, not of the machine (no fsync per line).

Restart reads the ids back one line at a time into an ``IdSet``, never holding outputs;
``--retry-errors`` first rewrites the errors file without the failures it sends again.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from app.batchclient.items import InvalidLine, Item, ItemId

_TAIL_CHUNK = 64 * 1024


class CorruptJournal(Exception):
    """A whole line (one with its newline) that is not a result line: not ours to repair."""


class IdSet:
    """A set of item ids in ~100 bytes each, whatever the ids' length, each with one mark
    (`mark`: a line of this run had it).

    Each id is kept as a 128-bit BLAKE2b digest of its JSON form (so 7 and "7" differ):
    two of a million ids collide with probability ~1e-27, and the set of a 1,000,000-line
    job stays near 100 MB instead of growing with the length of the ids. The mark lives in
    the same entry: a resumed job's ids are held once, not once as done and again as seen.
    """

    def __init__(self) -> None:
        self._digests: dict[int, bool] = {}  # digest -> marked

    @staticmethod
    def _digest(item_id: ItemId) -> int:
        return int.from_bytes(hashlib.blake2b(orjson.dumps(item_id), digest_size=16).digest())

    def add(self, item_id: ItemId) -> None:
        self._digests.setdefault(self._digest(item_id), False)

    def mark(self, item_id: ItemId) -> tuple[bool, bool]:
        """Mark the id; returns whether it was held before, and whether it was marked."""
        digest = self._digest(item_id)
        before = self._digests.get(digest)
        self._digests[digest] = True
        return before is not None, before is True

    def __contains__(self, item_id: object) -> bool:
        if isinstance(item_id, bool) or not isinstance(item_id, str | int):
            return False
        return self._digest(item_id) in self._digests

    def __len__(self) -> int:
        return len(self._digests)


def repair_torn_tail(path: Path) -> int:
    """Cut a last line that lacks its newline; returns the number of bytes removed."""
    if not path.exists():
        return 0
    with path.open("r+b") as file:
        size = file.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        file.seek(size - 1)
        if file.read(1) == b"\n":
            return 0
        end = size
        keep = 0
        while end > 0:
            start = max(0, end - _TAIL_CHUNK)
            file.seek(start)
            chunk = file.read(end - start)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                keep = start + newline + 1
                break
            end = start
        file.truncate(keep)
        return size - keep


# Errors of a line refused before any request (no answer was asked for its id): recorded by
# its line number, since its id is not its own (an invalid line has none; a duplicate's is
# an earlier line's).
INVALID_LINE = "invalid_line"
DUPLICATE_ID = "duplicate_id"
REFUSED_LINE_ERRORS = (INVALID_LINE, DUPLICATE_ID)


def line_digest(line: bytes) -> str:
    """A short digest of an input line's content (its line ending left out)."""
    return hashlib.blake2b(line.rstrip(b"\r\n"), digest_size=8).hexdigest()


class RefusedLines:
    """The input lines previous runs refused, by line number and content digest.

    A line is skipped as refused only while it is still the line that was refused: an
    input edited between runs (a line fixed, inserted or removed) has its changed lines
    read again instead of skipped unseen. A record without a digest (written before the
    digest was) matches whatever the line holds now.
    """

    def __init__(self) -> None:
        self._digests: dict[int, set[str | None]] = {}

    def add(self, line_number: int, digest: str | None) -> None:
        self._digests.setdefault(line_number, set()).add(digest)

    def refused(self, line_number: int, line: bytes) -> bool:
        digests = self._digests.get(line_number)
        if digests is None:
            return False
        return None in digests or line_digest(line) in digests

    def __len__(self) -> int:
        return len(self._digests)


def read_ids(
    path: Path,
    into: IdSet,
    refused_lines: RefusedLines | None = None,
    also_into: IdSet | None = None,
) -> int:
    """Add the id of every line of ``path`` to ``into`` and ``also_into`` (a refused line's
    number and digest to ``refused_lines`` instead, when given); returns how many lines it
    read.

    Call after ``repair_torn_tail``: every line must then be a whole result line.
    """
    if not path.exists():
        return 0
    count = 0
    with path.open("rb") as file:
        for number, line in enumerate(file, start=1):
            record, item_id, kind = _result_line(path, number, line)
            if refused_lines is not None and kind in REFUSED_LINE_ERRORS:
                refused_lines.add(int(record["line"]), record.get("line_digest"))
            else:
                into.add(item_id)
                if also_into is not None:
                    also_into.add(item_id)
            count += 1
    return count


def _result_line(path: Path, number: int, line: bytes) -> tuple[dict[str, Any], Any, Any]:
    """Line `number` of `path` as (its record, its id, its error type: None for an answer);
    `CorruptJournal` unless it is a result line."""
    try:
        record = orjson.loads(line)
        item_id = record["id"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        raise CorruptJournal(f"{path}:{number} is not a result line") from None
    error = record.get("error")
    return record, item_id, error.get("type") if isinstance(error, dict) else None


def drop_failures(path: Path, retried: IdSet) -> int:
    """Remove from the errors file at ``path`` the failure records of the ids in
    ``retried``, so those lines are unfinished and sent again; returns how many it removed.

    The records of lines refused before any request (``invalid_line``, ``duplicate_id``)
    stay: they are about the input line, read again only once it is edited. The file is
    rewritten as a stream into a temporary file that replaces it (``os.replace``), so a
    kill at any moment leaves the old file or the new one, never a mix. Call after
    ``repair_torn_tail``, before the run appends to the file.
    """
    if not path.exists():
        return 0
    dropped = 0
    temporary = path.with_name(path.name + ".retrying")
    try:
        with path.open("rb") as source, temporary.open("wb") as kept:
            for number, line in enumerate(source, start=1):
                _, item_id, kind = _result_line(path, number, line)
                if kind not in REFUSED_LINE_ERRORS and item_id in retried:
                    dropped += 1
                else:
                    kept.write(line)
            kept.flush()
            os.fsync(kept.fileno())
        if dropped:
            os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return dropped


def failed_lines_of(input_path: Path, errors_path: Path) -> IdSet:
    """The ids of INPUT's lines whose request failed in an earlier run (their record in
    the errors file, not one of a line refused before any request). Memory grows with the
    failures, not the input: the input is read as a stream against them."""
    failed = IdSet()
    read_ids(errors_path, failed, RefusedLines())
    found = IdSet()
    if not failed:
        return found
    with input_path.open("rb") as file:
        for line_number, line in enumerate(file, start=1):
            if not line.strip():
                continue
            try:
                item_id = Item.from_line(line, line_number).id
            except InvalidLine:
                continue
            if item_id in failed:
                found.add(item_id)
    return found


class Journal:
    """Appends whole lines to one file; the event loop's thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: BinaryIO | None = None
        self._whole_size = 0  # the file's size after its last whole line
        self.lines_written = 0

    def append(self, lines: Iterable[bytes]) -> None:
        """Write ``lines`` (each ending in a newline) with one write, then flush. A write
        that fails (a full disk) leaves no part of them: the file is cut back to its last
        whole line before the error is raised. This process must be the file's only writer.
        """
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # Unbuffered: each write goes to the OS as one call, so nothing sits in a
            # Python buffer when the process is killed.
            self._file = self.path.open("ab", buffering=0)
            self._whole_size = os.fstat(self._file.fileno()).st_size
        data = b"".join(lines)
        view = memoryview(data)
        try:
            while view:
                written = self._file.write(view)
                view = view[written or 0 :]
        except BaseException:
            # Part of a line may be on disk: a reader of the file (or the summary's count)
            # would take it for a result until the next run's repair_torn_tail.
            with contextlib.suppress(OSError):
                os.ftruncate(self._file.fileno(), self._whole_size)
            raise
        self._whole_size += len(data)
        self.lines_written += data.count(b"\n")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def errors_path_for(output: Path) -> Path:
    """OUTPUT.jsonl -> OUTPUT.errors.jsonl (any other name: NAME.errors.jsonl)."""
    name = output.name
    stem = name[: -len(".jsonl")] if name.endswith(".jsonl") else name
    return output.with_name(f"{stem}.errors.jsonl")
