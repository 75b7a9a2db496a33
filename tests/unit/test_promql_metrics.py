"""Every PromQL expression of the Grafana dashboard and of the alert rules names only metrics (and, in
label matchers, only labels) that the scheduler and the device plugin really export.

The exported names come from the processes' own registries (`SchedulerMetrics`, `PluginMetrics`), with
the suffixes Prometheus sees on the wire: `_total` for counters, `_bucket`/`_count`/`_sum` for
histograms. Labels `instance` and `job` are added by Prometheus to every scraped series; labels joined
in with `group_left (node)` come from `gpupool_deviceplugin_node_info`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from gpupool_deviceplugin.metrics import PluginMetrics
from gpupool_sched.metrics import SchedulerMetrics

FILES = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "gpupool" / "files"
DASHBOARD = FILES / "gpupool-dashboard.json"
ALERTS = FILES / "gpupool-alerts.yaml"
TARGET_LABELS = {"instance", "job"}  # added by Prometheus at scrape time

_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",),
             "summary": ("", "_count", "_sum"), "info": ("_info",)}
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring", "group_left",
             "group_right", "inf", "nan", "atan2"}
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_SELECTOR = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(=~|!~|!=|=)\s*\"(?:[^\"\\]|\\.)*\"\s*,?")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_RANGE = re.compile(r"\[[^\]]*\]")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])\d[\dA-Za-z_.]*")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def exported() -> dict[str, set[str]]:
    """Series name as scraped -> the labels the code gives it."""
    out: dict[str, set[str]] = {}
    for owner in (SchedulerMetrics(), PluginMetrics()):
        registry: CollectorRegistry = owner.registry
        labels_by_family = {m._name: set(m._labelnames) for m in vars(owner).values()
                            if isinstance(m, MetricWrapperBase)}
        for family in registry.collect():
            labels = labels_by_family.get(family.name, set())
            for suffix in _SUFFIXES[family.type]:
                extra = {"le"} if suffix == "_bucket" else set()
                out[family.name + suffix] = labels | extra
    return out


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (function and keyword names are not metrics)."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    names = set()
    for match in _IDENT.finditer(text):
        name = match.group(0)
        following = text[match.end():].lstrip()
        if name.lower() in _KEYWORDS or following.startswith("("):
            continue
        names.add(name)
    return names


def matched_labels(expr: str) -> Iterator[tuple[str, str]]:
    """(metric, label) for every label matcher written on a metric selector."""
    for selector in _SELECTOR.finditer(_STRING.sub('""', expr)):
        metric, body = selector.groups()
        for matcher in _MATCHER.finditer(body):
            yield metric, matcher.group(1)


def dashboard_exprs() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dash["panels"]:
        for target in panel.get("targets", ()):
            out.append((f"panel {panel['title']!r} {target['refId']}", target["expr"]))
    return out


def alert_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [(f"rule {rule.get('alert') or rule.get('record')}", rule["expr"])
            for group in rules["groups"] for rule in group["rules"]]


EXPRESSIONS = dashboard_exprs() + alert_exprs()


def test_the_extractor_finds_metrics_and_skips_functions_keywords_and_labels() -> None:
    expr = ('histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{x="y", z=~"[1-9]{6,}"}[5m])))'
            ' / on (instance) group_left (node) b_info > 0.5 and on () max(c) or vector(0)')
    assert metric_names(expr) == {"a_seconds_bucket", "b_info", "c"}
    assert set(matched_labels(expr)) == {("a_seconds_bucket", "x"), ("a_seconds_bucket", "z")}
    assert metric_names("sum(rate(x_total[$__rate_interval])) by (reason)") == {"x_total"}


def test_the_registries_export_the_suffixed_names() -> None:
    names = exported()
    assert "gpupool_scheduler_schedule_attempts_total" in names
    assert "gpupool_scheduler_schedule_attempts" not in names
    assert {"gpupool_scheduler_pod_scheduling_duration_seconds_bucket",
            "gpupool_scheduler_pod_scheduling_duration_seconds_count"} <= set(names)
    assert names["gpupool_deviceplugin_registered"] == {"resource"}


def test_dashboard_and_rules_have_expressions() -> None:
    assert len(dashboard_exprs()) >= 15
    assert len(alert_exprs()) >= 5


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_expression_names_only_exported_metrics_and_labels(where: str, expr: str) -> None:
    names = exported()
    used = metric_names(expr)
    assert used, f"{where}: no metric found in {expr!r}"
    unknown = sorted(used - set(names))
    assert not unknown, f"{where}: {unknown} are not exported by the scheduler or the device plugin"
    for metric, label in matched_labels(expr):
        assert label in names[metric] | TARGET_LABELS, f"{where}: {metric} has no label {label!r}"


def test_a_wrong_metric_name_is_caught() -> None:
    names = set(exported())
    assert metric_names("sum(rate(gpupool_scheduler_schedule_attempts[5m]))") - names == {
        "gpupool_scheduler_schedule_attempts"}  # a counter without _total is not on the wire
