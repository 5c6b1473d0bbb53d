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


def exported_labels() -> dict[str, frozenset[str]]:
    """Each series name a scrape can carry -> the label names its samples have (a
    histogram's `_bucket` also has `le`)."""
    labels: dict[str, frozenset[str]] = {}
    registry = Metrics().registry
    for collector, names in registry._collector_to_names.items():
        own = frozenset(getattr(collector, "_labelnames", ()))
        for name in names:
            labels[name] = own | {"le"} if name.endswith("_bucket") else own
    return labels
