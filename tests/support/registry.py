"""The metric names steadyserve's own registry exports, as Prometheus sees them: the one
source of truth that docs, alerts and dashboards are checked against."""

from __future__ import annotations

from app.metrics import Metrics

_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def exported_names() -> set[str]:
    """Every series name a scrape of the server can carry (families with no sample yet
    included: a GPU gauge exists even on a machine without a GPU)."""
    names: set[str] = set()
    for family in Metrics().registry.collect():
        for suffix in _SUFFIXES.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names
