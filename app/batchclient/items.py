"""Items in, results out, and how several items share one /infer request.

An item is one input line: an /infer body and an id. A result is either a ``Success``
(the server's answer for that item alone) or a ``Failure`` (why it has none). Both turn
into the one JSON line the CLI writes for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

ItemId = str | int


class InvalidLine(ValueError):
    """An input line that cannot become a request (not JSON, not an object, a bad id)."""


@dataclass(frozen=True, slots=True)
class Item:
    """One /infer body (``{"inputs": ..., "model"?, "parameters"?, "timeout_ms"?}``)."""

    id: ItemId
    body: Mapping[str, Any]

    @classmethod
    def from_line(cls, line: bytes, line_number: int) -> Item:
        """Parse a JSONL line; the id defaults to the 1-based line number. A UTF-8 byte
        order mark opening the file (Windows tools write one) is not part of line 1."""
        if line_number == 1:
            line = line.removeprefix(b"\xef\xbb\xbf")
        try:
            value = orjson.loads(line)
        except orjson.JSONDecodeError as error:
            raise InvalidLine(f"line {line_number} is not JSON: {error}") from None
        if not isinstance(value, dict):
            raise InvalidLine(f"line {line_number} is not a JSON object")
        item_id = value.pop("id", line_number)
        if isinstance(item_id, bool) or not isinstance(item_id, str | int):
            raise InvalidLine(f"line {line_number}: id must be a string or an integer")
        return cls(item_id, value)

    @property
    def texts(self) -> list[str] | None:
        """The inputs as a list when they can be packed with other items', else None."""
        inputs = self.body.get("inputs")
        if isinstance(inputs, str):
            return [inputs]
        if isinstance(inputs, list) and inputs and all(isinstance(t, str) for t in inputs):
            return inputs
        return None


@dataclass(frozen=True, slots=True)
class Success:
    """The server's answer for one item: ``{"model", "outputs", "usage", ...}``."""

    id: ItemId
    response: Mapping[str, Any]
    attempts: int
    latency_s: float

    @property
    def outputs(self) -> list[Any]:
        """An embedding model's vectors, a generate model's ``{"text", "finish_reason",
        ...}`` objects: one per input of the item."""
        outputs: list[Any] = self.response["outputs"]
        return outputs

    def json_line(self) -> bytes:
        return orjson.dumps({"id": self.id, **self.response}) + b"\n"


@dataclass(frozen=True, slots=True)
class Failure:
    """Why an item has no answer: ``status`` is None when no HTTP response came."""

    id: ItemId
    status: int | None
    error: Mapping[str, Any]
    attempts: int
    retryable: bool
    line: int | None = None  # set, with its digest, for a line refused before any request
    line_digest: str | None = None
    reason: str | None = None  # why the client gave up, when not the server's error alone

    def json_line(self) -> bytes:
        record: dict[str, Any] = {"id": self.id, "status": self.status, "error": self.error}
        record["attempts"] = self.attempts
        record["retryable"] = self.retryable
        if self.line is not None:
            record["line"] = self.line
            record["line_digest"] = self.line_digest
        if self.reason is not None:
            record["reason"] = self.reason
        return orjson.dumps(record) + b"\n"


Result = Success | Failure


@dataclass(frozen=True, slots=True)
class Request:
    """The items one POST carries, and its encoded body."""

    items: tuple[Item, ...]
    counts: tuple[int, ...]  # inputs each item contributed, in order
    body: bytes = field(repr=False)

    @classmethod
    def single(cls, item: Item) -> Request:
        texts = item.texts
        return cls((item,), (len(texts) if texts else 1,), orjson.dumps(dict(item.body)))

    @classmethod
    def packed(cls, items: Sequence[Item]) -> Request:
        if len(items) == 1:
            return cls.single(items[0])
        texts: list[str] = []
        counts = []
        for item in items:
            item_texts = item.texts
            assert item_texts is not None, "only items with text inputs are packed"
            texts.extend(item_texts)
            counts.append(len(item_texts))
        body = {**items[0].body, "inputs": texts}
        return cls(tuple(items), tuple(counts), orjson.dumps(body))

    def split(self) -> list[Request]:
        """One request per item: how a refused pack finds out which item was at fault."""
        return [Request.single(item) for item in self.items]

    def unpack(self, response: Mapping[str, Any], attempts: int, latency_s: float) -> list[Result]:
        """Each item's share of a 2xx answer; a malformed answer fails every item."""
        outputs = response.get("outputs")
        if not isinstance(outputs, list) or len(outputs) != sum(self.counts):
            error = {"type": "bad_response", "message": "outputs missing or of the wrong length"}
            return [Failure(i.id, 200, error, attempts, retryable=True) for i in self.items]
        if len(self.items) == 1:
            return [Success(self.items[0].id, response, attempts, latency_s)]
        shared = {k: v for k, v in response.items() if k not in ("outputs", "usage")}
        results: list[Result] = []
        offset = 0
        for item, count in zip(self.items, self.counts, strict=True):
            share = {**shared, "outputs": outputs[offset : offset + count]}
            share["usage"] = _usage_of(share["outputs"], count)
            results.append(Success(item.id, share, attempts, latency_s))
            offset += count
        return results


def _usage_of(outputs: list[Any], count: int) -> dict[str, int]:
    """An item's usage as /infer answers it for that item alone. A generate model's outputs
    carry their own token counts, whose sums are its usage; an embedding model's do not, and
    a packed request's token count cannot be split between its items: the input count only."""
    prompt_tokens: list[int] = []
    completion_tokens: list[int] = []
    for output in outputs:
        prompt = output.get("prompt_tokens") if isinstance(output, dict) else None
        completion = output.get("completion_tokens") if isinstance(output, dict) else None
        if not isinstance(prompt, int) or not isinstance(completion, int):
            return {"inputs": count}
        prompt_tokens.append(prompt)
        completion_tokens.append(completion)
    return {
        "input_tokens": sum(prompt_tokens),
        "output_tokens": sum(completion_tokens),
        "inputs": count,
    }


def _seeded(item: Item) -> bool:
    parameters = item.body.get("parameters")
    return isinstance(parameters, Mapping) and parameters.get("seed") is not None


def _pack_key(item: Item) -> bytes | None:
    """Items with equal keys may share a request: same model, parameters, deadline. None
    (sent alone) for an item whose inputs are not texts, or whose parameters hold a `seed`:
    the server gives a request's input i > 0 a seed derived from the request's and i
    (`generation/seeds.py::prompt_seed`), so packed, a seeded line's sample would depend
    on where it landed in its pack, and change when a refused pack is resent one line at a
    time or a resumed run packs it otherwise."""
    if item.texts is None or _seeded(item):
        return None
    rest = {k: v for k, v in item.body.items() if k != "inputs"}
    return orjson.dumps(rest, option=orjson.OPT_SORT_KEYS)


class Packer:
    """Groups consecutive compatible items into requests of at most ``inputs_per_request``
    inputs. Streaming: it holds one request's items at a time. One caller at a time."""

    def __init__(self, inputs_per_request: int) -> None:
        self.inputs_per_request = max(1, inputs_per_request)
        self._group: list[Item] = []
        self._key: bytes | None = None
        self._inputs = 0

    def add(self, item: Item) -> list[Request]:
        """The requests that are complete once ``item`` is added (zero, one or two)."""
        if self.inputs_per_request == 1:
            return [Request.single(item)]
        key = _pack_key(item)
        size = len(item.texts or ())
        ready: list[Request] = []
        if self._group and (key != self._key or self._inputs + size > self.inputs_per_request):
            ready.extend(self.flush())
        if key is None:
            ready.append(Request.single(item))
            return ready
        self._group.append(item)
        self._key = key
        self._inputs += size
        return ready

    def flush(self) -> list[Request]:
        """The partly filled request, if any (at the end of the input)."""
        if not self._group:
            return []
        request = Request.packed(self._group)
        self._group, self._key, self._inputs = [], None, 0
        return [request]
