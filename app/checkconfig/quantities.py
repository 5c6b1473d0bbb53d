"""Kubernetes resource quantities ("500m", "4", 4, "8Gi", "8192Mi", "1e3") as exact numbers,
so that two spellings of one amount compare equal, as they are to Kubernetes."""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any

from app.checkconfig.common import ConfigError

# The quantity grammar of k8s.io/apimachinery: a number, then a binary or decimal SI suffix
# or a decimal exponent.
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+))(?:([eE][+-]?\d+)|([KMGTPE]i|[numkMGTPE])?)$")
_SUFFIXES: dict[str, Fraction] = {
    **{f"{s}i": Fraction(1024**power) for power, s in enumerate("KMGTPE", start=1)},
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 10**3),
    "k": Fraction(10**3),
    **{s: Fraction(1000**power) for power, s in enumerate("MGTPE", start=2)},
}


def parse_quantity(value: Any) -> Fraction:
    """The amount a quantity stands for: CPUs for "500m" (1/2), bytes for "8Gi"."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):  # YAML .inf or .nan
            raise ConfigError(f"{value!r} is not a Kubernetes quantity")
        return Fraction(str(value))
    match = _QUANTITY.match(value) if isinstance(value, str) else None
    if match is None:
        raise ConfigError(f"{value!r} is not a Kubernetes quantity")
    number, exponent, suffix = match.groups()
    amount = Fraction(number)
    if exponent:
        return amount * Fraction(10) ** int(exponent[1:])
    return amount * _SUFFIXES[suffix] if suffix else amount


def same_quantity(first: Any, second: Any) -> bool:
    """Whether two quantities (either may be absent: None) stand for the same amount."""
    if first is None or second is None:
        return first is second
    return parse_quantity(first) == parse_quantity(second)


def cpu_count(quantity: Any) -> int:
    """A CPU quantity rounded up to whole CPUs, as a divisor-1 resourceFieldRef gives it."""
    return max(1, math.ceil(parse_quantity(quantity)))
