"""The labels the alert rules and the dashboard select, group by and print are labels the
server's metrics have (its registry), or ones Prometheus adds to every scraped series: a
renamed or misspelt label matches nothing, and `task!="generate"` then silently counts
generations in the embedding latency alerts."""

from __future__ import annotations

import re

import yaml

from tests.deploy.test_alert_rules import ALERTS
from tests.deploy.test_grafana_dashboard import dashboard
from tests.support.registry import exported_labels

# Added by Prometheus and the ServiceMonitor's relabelling to every series it scrapes.
TARGET_LABELS = frozenset({"instance", "job", "pod", "namespace", "container", "service"})

_SELECTOR = re.compile(r"\b(steadyserve_[a-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")
_NAME = re.compile(r"\b(steadyserve_[a-z0-9_]+)")


def label_problems(expr: str, printed: set[str]) -> list[str]:
    """Labels of `expr` (matchers, grouping) and `printed` (legend or annotation labels)
    that none of its steadyserve series has. Queries of Envoy's stats are left to Envoy."""
    known = exported_labels()
    problems = []
    for name, matchers in _SELECTOR.findall(expr):
        for label in _MATCHER.findall(matchers):
            if label not in known[name] | TARGET_LABELS:
                problems.append(f"{name} has no label {label!r}")
    if "envoy_" in expr:
        return problems
    names = _NAME.findall(expr)
    available = TARGET_LABELS.union(*(known[name] for name in names))
    grouped = {label.strip() for group in _GROUPING.findall(expr) for label in group.split(",")}
    for label in (grouped | printed) - {""}:
        if label not in available:
            problems.append(f"{label!r} is a label of none of {sorted(set(names))}")
    return problems


def test_dashboard_queries_and_legends_use_labels_the_metrics_have() -> None:
    problems = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            printed = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
            for problem in label_problems(target["expr"], printed):
                problems.append(f"{panel['title']}: {problem}")
    assert not problems, problems


def test_alert_queries_and_annotations_use_labels_the_metrics_have() -> None:
    problems = []
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            text = " ".join(str(v) for v in rule.get("annotations", {}).values())
            printed = set(re.findall(r"\$labels\.(\w+)", text))
            for problem in label_problems(rule["expr"], printed):
                problems.append(f"{rule['alert']}: {problem}")
    assert not problems, problems


def test_a_label_the_metric_lacks_is_caught() -> None:
    expr = 'sum by (model) (rate(steadyserve_request_duration_seconds_count{tsk!="x"}[5m]))'
    assert label_problems(expr, {"gpu"}) == [
        "steadyserve_request_duration_seconds_count has no label 'tsk'",
        "'gpu' is a label of none of ['steadyserve_request_duration_seconds_count']",
    ]


def test_every_panel_of_a_per_model_metric_follows_the_model_variable() -> None:
    """Two panels ignored `$model`: picking a model left them showing every model's."""
    known = exported_labels()
    ignoring = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            per_model = [name for name in _NAME.findall(expr) if "model" in known[name]]
            selectors = dict(_SELECTOR.findall(expr))
            for name in per_model:
                # `$model|`: also the series of no model (refusals decided before the body)
                if not re.search(r'model=~"\$model\|?"', selectors.get(name, "")):
                    ignoring.append(f"{panel['title']}: {name}")
    assert not ignoring, ignoring
