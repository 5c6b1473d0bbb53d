"""Request bodies: read from a JSONL file or generated as sentences of chosen lengths.

Bodies are encoded once, before the run, and cycled through; the hot path only picks the
next ready-made ``bytes``. Mixed lengths matter because steadyserve pads each input to a
length bucket: a run of identical sentences exercises one bucket only.
"""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Everyday words, so the tokenizer sees ordinary word pieces (about 1.2 tokens a word).
_VOCABULARY_TEXT = """
    the of and to in is was he for it with as his on be at by had are but from or have
    an they which one you were her all she there would their we him been has when who
    will more no if out so said what up its about into than them can only other new some
    could time these two may then do first any my now such like our over man me even most
    made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still
    own see men work long get here between both life being under never day same another
    know while last might us great old year off come since against go came right used take
    three states himself few house use during without again place american around however
    home small found thought went say part once general high upon school every does got
    united left number course war until always away something fact though water less
    public put think almost hand enough far took head yet government system better set
    told nothing night end why called hold eyes find going look asked later knew point
    next program city business give group toward young days let room president side
    social given present several order national possible rather second face per among
    form important often things looked early white case john become large big need four
    within felt along children saw best church ever least power development light thing
    seemed family interest want members mind country area others done turned although
    open god service certain kind problem began different door thus help sense means whole
    matter perhaps itself york times law human line above name example action company
    local show whether five history gave today either act feet across taken past quite
    anything seen having death week experience body word half really field am car words
    already themselves information tell together college shall money period held keep sure
    real probably free seems political cannot behind miss question air office making
    brought whose special heard major problems ago became federal moment study available
    """
VOCABULARY: tuple[str, ...] = tuple(_VOCABULARY_TEXT.split())


@dataclass(frozen=True, slots=True)
class LengthDistribution:
    """Words per generated sentence.

    ``fixed:12``; ``uniform:4-64`` (inclusive); ``lognormal:12:0.8`` (median 12 words,
    sigma 0.8 of the underlying normal: mostly short texts with a long tail, like real
    traffic), optionally capped: ``lognormal:12:0.8:300``.
    """

    kind: str
    first: float
    second: float = 0.0
    cap: int = 400

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        kind, _, rest = text.partition(":")
        try:
            if kind == "fixed":
                return cls("fixed", float(int(rest)))
            if kind == "uniform":
                low, _, high = rest.partition("-")
                if int(low) > int(high):
                    raise ValueError("uniform range is reversed")
                return cls("uniform", float(int(low)), float(int(high)))
            if kind == "lognormal":
                parts = rest.split(":")
                cap = int(parts[2]) if len(parts) > 2 else 400
                return cls("lognormal", float(parts[0]), float(parts[1]), cap)
        except (ValueError, IndexError) as error:
            raise ValueError(f"bad length distribution {text!r}: {error}") from error
        raise ValueError(
            f"bad length distribution {text!r}: use fixed:N, uniform:A-B or lognormal:MEDIAN:SIGMA"
        )

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            words = self.first
        elif self.kind == "uniform":
            words = rng.randint(int(self.first), int(self.second))
        else:
            words = round(rng.lognormvariate(math.log(self.first), self.second))
        return int(min(max(words, 1), self.cap))


def sentence(words: int, rng: random.Random) -> str:
    chosen = [rng.choice(VOCABULARY) for _ in range(words)]
    chosen[0] = chosen[0].capitalize()
    return " ".join(chosen) + "."


class BodyPool:
    """Ready-encoded request bodies handed out round-robin."""

    def __init__(self, bodies: Sequence[bytes]) -> None:
        if not bodies:
            raise ValueError("no request bodies")
        self.bodies = list(bodies)
        self._next = 0

    def next(self) -> bytes:
        body = self.bodies[self._next]
        self._next = (self._next + 1) % len(self.bodies)
        return body

    def __len__(self) -> int:
        return len(self.bodies)


def generated_bodies(
    count: int,
    lengths: LengthDistribution,
    inputs_per_request: int = 1,
    seed: int | None = None,
    extra_fields: Mapping[str, Any] | None = None,
) -> BodyPool:
    """``count`` distinct ``/infer`` bodies: ``{"inputs": "..."}`` or a list of texts."""
    rng = random.Random(seed)
    bodies: list[bytes] = []
    for _ in range(count):
        texts = [sentence(lengths.sample(rng), rng) for _ in range(inputs_per_request)]
        inputs: str | list[str] = texts[0] if inputs_per_request == 1 else texts
        document = {"inputs": inputs, **(extra_fields or {})}
        bodies.append(json.dumps(document, separators=(",", ":")).encode())
    return BodyPool(bodies)


_BLANK = re.compile(rb"^\s*$")


def jsonl_bodies(path: Path, extra_fields: Mapping[str, Any] | None = None) -> BodyPool:
    """One body per non-blank line of a JSONL file, each a JSON object sent as it is
    (merged with ``extra_fields``). A bad line fails here, not halfway through a run."""
    bodies: list[bytes] = []
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if _BLANK.match(line):
            continue
        try:
            document = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON: {error}") from error
        if not isinstance(document, dict):
            raise ValueError(f"{path}:{number}: each line must be a JSON object")
        document.update(extra_fields or {})
        bodies.append(json.dumps(document, separators=(",", ":")).encode())
    return BodyPool(bodies)
