"""The extender's Prometheus metrics: per-verb latency and errors; the binder's own metrics (the
scheduler's `gpupool_scheduler_bind_*`, gate waits) share the registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gpupool_sched.metrics import SchedulerMetrics

VERBS = ("filter", "prioritize", "bind", "preempt")
_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class ExtenderMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "gpupool_extender_request_duration_seconds",
            "Time from the request's arrival to the answer, by verb (body read, decision, Binding POST)",
            ["verb"], buckets=_BUCKETS, registry=r)
        self.errors = Counter(
            "gpupool_extender_request_errors",
            "Requests answered with an HTTP error or an `Error` field, by verb and reason",
            ["verb", "reason"], registry=r)
        self.filtered = Counter(
            "gpupool_extender_filter_nodes", "Nodes the filter verb passed or failed", ["result"], registry=r)
        self.binder = SchedulerMetrics(r)
