"""Input lines, packing, and the output journal: torn-tail repair and reading ids back."""

from __future__ import annotations

import errno
from pathlib import Path
from typing import BinaryIO

import orjson
import pytest

from app.batchclient.items import Failure, InvalidLine, Item, Packer, Request, Success
from app.batchclient.journal import (
    CorruptJournal,
    IdSet,
    Journal,
    errors_path_for,
    read_ids,
    repair_torn_tail,
)


def test_item_id_defaults_to_the_line_number_and_is_removed_from_the_body() -> None:
    assert Item.from_line(b'{"inputs": "a"}', 7) == Item(7, {"inputs": "a"})
    assert Item.from_line(b'{"id": "x", "inputs": ["a"]}', 7) == Item("x", {"inputs": ["a"]})


def test_a_byte_order_mark_opening_the_file_is_not_part_of_line_one() -> None:
    assert Item.from_line(b'\xef\xbb\xbf{"inputs": "a"}', 1) == Item(1, {"inputs": "a"})
    with pytest.raises(InvalidLine):  # anywhere else it is a stray character
        Item.from_line(b'\xef\xbb\xbf{"inputs": "a"}', 2)


@pytest.mark.parametrize("line", [b"not json", b"[1, 2]", b'{"id": 1.5, "inputs": "a"}'])
def test_invalid_lines_are_refused(line: bytes) -> None:
    with pytest.raises(InvalidLine):
        Item.from_line(line, 3)


def test_packer_groups_compatible_items_up_to_the_input_limit() -> None:
    packer = Packer(4)
    items = [
        Item(1, {"inputs": "a"}),
        Item(2, {"inputs": ["b", "c"]}),
        Item(3, {"inputs": "d"}),
        Item(4, {"inputs": "e"}),  # would make 5 inputs: starts a new request
        Item(5, {"inputs": "f", "parameters": {"normalize": False}}),  # other parameters
        Item(6, {"inputs": 42}),  # not text: alone, so the server's 422 names this item
    ]
    requests = [request for item in items for request in packer.add(item)] + packer.flush()
    assert [[i.id for i in r.items] for r in requests] == [[1, 2, 3], [4], [5], [6]]
    first = orjson.loads(requests[0].body)
    assert first == {"inputs": ["a", "b", "c", "d"]}
    assert requests[0].counts == (1, 2, 1)


def test_a_seeded_line_is_never_packed() -> None:
    """The server seeds a request's input i > 0 from the request's seed and i: packed, a
    seeded line's sample depended on its place in the pack (and changed when the pack was
    resent a line at a time, or a resumed run packed it otherwise)."""
    packer = Packer(8)
    seeded = {"do_sample": True, "seed": 7}
    items = [
        Item(1, {"inputs": "a", "parameters": seeded}),
        Item(2, {"inputs": "b", "parameters": seeded}),
        Item(3, {"inputs": ["c", "d"], "parameters": seeded}),  # its own list: as sent
        Item(4, {"inputs": "e", "parameters": {"seed": None}}),  # no seed: packed
        Item(5, {"inputs": "f", "parameters": {"seed": None}}),
    ]
    requests = [request for item in items for request in packer.add(item)] + packer.flush()
    assert [[i.id for i in r.items] for r in requests] == [[1], [2], [3], [4, 5]]
    assert orjson.loads(requests[2].body) == {"inputs": ["c", "d"], "parameters": seeded}


def test_unpacking_gives_each_item_its_own_outputs() -> None:
    request = Request.packed([Item("a", {"inputs": ["x", "y"]}), Item("b", {"inputs": "z"})])
    answer = {"model": "m", "outputs": [[1.0], [2.0], [3.0]], "usage": {"inputs": 3}}
    results = request.unpack(answer, attempts=1, latency_s=0.01)
    assert [(r.id, r.outputs) for r in results if isinstance(r, Success)] == [
        ("a", [[1.0], [2.0]]),
        ("b", [[3.0]]),
    ]
    short = request.unpack({"model": "m", "outputs": [[1.0]]}, attempts=1, latency_s=0.0)
    assert all(isinstance(r, Failure) for r in short)


def test_a_packed_generate_items_usage_is_its_own_outputs_tokens() -> None:
    """As /infer answers the item alone; the split kept only its input count, dropping a
    generate model's token usage from every packed line."""
    request = Request.packed([Item("a", {"inputs": ["x", "y"]}), Item("b", {"inputs": "z"})])
    outputs = [
        {"text": t, "finish_reason": "length", "prompt_tokens": p, "completion_tokens": c}
        for t, p, c in (("1", 3, 5), ("2", 4, 6), ("3", 7, 2))
    ]
    answer = {"model": "m", "outputs": outputs, "usage": {"input_tokens": 14, "inputs": 3}}
    results = request.unpack(answer, attempts=1, latency_s=0.0)
    assert [r.response["usage"] for r in results if isinstance(r, Success)] == [
        {"input_tokens": 7, "output_tokens": 11, "inputs": 2},
        {"input_tokens": 7, "output_tokens": 2, "inputs": 1},
    ]
    assert [r.outputs for r in results if isinstance(r, Success)] == [outputs[:2], outputs[2:]]


def test_result_lines() -> None:
    success = Success("a", {"model": "m", "outputs": [[0.5]], "usage": {"inputs": 1}}, 1, 0.0)
    assert orjson.loads(success.json_line()) == {
        "id": "a",
        "model": "m",
        "outputs": [[0.5]],
        "usage": {"inputs": 1},
    }
    failure = Failure(3, 422, {"type": "invalid_request"}, attempts=1, retryable=False)
    assert orjson.loads(failure.json_line())["status"] == 422


def test_id_set_tells_strings_from_integers() -> None:
    ids = IdSet()
    ids.add(7)
    ids.add("doc-1")
    assert 7 in ids and "doc-1" in ids
    assert "7" not in ids and 8 not in ids and True not in ids
    assert len(ids) == 2


def test_torn_last_line_is_cut_and_whole_lines_are_kept(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    whole = b'{"id":1,"outputs":[]}\n{"id":2,"outputs":[]}\n'
    path.write_bytes(whole + b'{"id":3,"outp')
    assert repair_torn_tail(path) == len(b'{"id":3,"outp')
    assert path.read_bytes() == whole
    assert repair_torn_tail(path) == 0
    ids = IdSet()
    assert read_ids(path, ids) == 2
    assert 1 in ids and 2 in ids and 3 not in ids


def test_a_torn_first_line_leaves_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b"x" * 200_000)  # longer than one read of the tail
    assert repair_torn_tail(path) == 200_000
    assert path.read_bytes() == b""


def test_a_damaged_whole_line_is_not_guessed_at(tmp_path: Path) -> None:
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id":1}\ngarbage\n{"id":2}\n')
    with pytest.raises(CorruptJournal, match=":2 "):
        read_ids(path, IdSet())


def test_journal_appends_whole_lines(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "sub" / "out.jsonl")
    journal.append([b'{"id":1}\n', b'{"id":2}\n'])
    journal.append([b'{"id":3}\n'])
    journal.close()
    assert journal.lines_written == 3
    assert (tmp_path / "sub" / "out.jsonl").read_bytes().count(b"\n") == 3


class _DiskFillsUp:
    """A file whose disk fills up after ``room`` more bytes: short writes, then ENOSPC."""

    def __init__(self, file: BinaryIO, room: int) -> None:
        self._file = file
        self._room = room

    def write(self, data: memoryview) -> int:
        if self._room == 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        written = self._file.write(data[: self._room])
        self._room -= written
        return written

    def __getattr__(self, name: str) -> object:
        return getattr(self._file, name)


def test_a_write_that_fails_leaves_no_part_of_a_line(tmp_path: Path) -> None:
    """A full disk mid-line left the torn line in the output until a rerun cut it."""
    path = tmp_path / "out.jsonl"
    path.write_bytes(b'{"id":0}\n')  # a previous run's
    journal = Journal(path)
    journal.append([b'{"id":1}\n'])
    assert journal._file is not None
    journal._file = _DiskFillsUp(journal._file, room=12)  # type: ignore[assignment]
    with pytest.raises(OSError, match="No space"):
        journal.append([b'{"id":2}\n', b'{"id":3}\n'])
    journal.close()
    assert path.read_bytes() == b'{"id":0}\n{"id":1}\n'
    assert journal.lines_written == 1


def test_errors_path_sits_next_to_the_output() -> None:
    assert errors_path_for(Path("/x/out.jsonl")) == Path("/x/out.errors.jsonl")
    assert errors_path_for(Path("/x/out")) == Path("/x/out.errors.jsonl")
