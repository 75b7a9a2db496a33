"""`gpupool simulate --mode time`: a trace, a policy and a list of loads into one time-mode report per load."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from gpupool_sched.cache.state import ClusterState
from gpupool_sched.framework.plugins.defrag_config import DefragConfig
from gpupool_sched.kube.nodes import NodeView
from gpupool_sched.placement.fragmentation import WorkloadProfile, cluster_fragmentation_milli
from gpupool_sched.placement.registry import build_policy
from gpupool_sched.simulate.lifetimes import DEFAULT_PATIENCE_S, TimedPod, read_pod_times, timed_pods
from gpupool_sched.simulate.pacing import arrival_rate, poisson_arrivals, prefill
from gpupool_sched.simulate.timegangs import GangSpec, GangStats, TimeGangs
from gpupool_sched.simulate.timeline import Timeline, TimeStats
from gpupool_sched.simulate.trace import BUNDLED_PODS, Trace, bundled_path

DAY_S = 86400.0


@dataclass(frozen=True, slots=True)
class TimeSettings:
    loads: tuple[float, ...] = (0.8, 1.0, 1.2)
    duration_s: float = DAY_S
    horizon_s: float = 7 * DAY_S
    patience_s: float = DEFAULT_PATIENCE_S
    seed: int = 42
    policy: str = "gpupool"
    samples: int = 0  # points over time for the plot (0: none)
    defrag: DefragConfig = field(default_factory=DefragConfig)  # consolidate: on, the scheduler's defaults
    gangs: GangSpec | None = None  # synthetic gangs (timegangs.py); None: every arrival is a lone pod


@dataclass(frozen=True)
class TimeReport:
    policy: str
    trace: str
    seed: int
    load: float
    stats: TimeStats
    rate_per_s: float
    priorities: dict[str, int]  # PriorityClass -> value, of the classes the trace uses
    defrag: DefragConfig = field(default_factory=DefragConfig)
    gang_spec: GangSpec | None = None
    gangs: GangStats | None = None  # with gang_spec: what became of the gangs

    @property
    def moved_pct(self) -> float:
        """Pods moved (migrations) as a share of the pods that arrived."""
        return 100 * self.stats.migrations / self.stats.arrivals if self.stats.arrivals else 0.0

    @property
    def span_s(self) -> float:
        return self.stats.end - self.stats.start

    @property
    def offered_pct(self) -> float:
        return 100 * self.stats.offered_milli_s / (self.stats.capacity_milli * self.span_s)

    @property
    def allocated_pct(self) -> float:
        return 100 * self.stats.allocated_milli_s / (self.stats.capacity_milli * self.span_s)

    @property
    def idle_gpu_hours_while_waiting(self) -> float:
        return self.stats.idle_while_waiting_milli_s / 1000 / 3600

    def delay_percentiles(self) -> dict[str, dict[str, float | int]]:
        out: dict[str, dict[str, float | int]] = {}
        for cls in sorted(self.priorities, key=lambda c: -self.priorities[c]):
            waits = self.stats.delays.get(cls, [])
            if waits:
                p50, p99 = np.percentile(np.asarray(waits), [50, 99]).tolist()
                out[cls] = {"placed": len(waits), "p50_s": round(p50, 1), "p99_s": round(p99, 1)}
            else:
                out[cls] = {"placed": 0, "p50_s": 0.0, "p99_s": 0.0}
        return out

    def json(self) -> dict[str, Any]:
        out = self._json()
        if self.gang_spec is not None and self.gangs is not None:
            out["gangs"] = self.gangs.json(self.gang_spec)
        return out

    def _json(self) -> dict[str, Any]:
        s = self.stats
        return {
            "mode": "time", "policy": self.policy, "trace": self.trace, "seed": self.seed, "load": self.load,
            "days": round(self.span_s / DAY_S, 4), "total_gpus": s.capacity_milli // 1000,
            "arrival_rate_per_s": round(self.rate_per_s, 6), "offered_pct": round(self.offered_pct, 2),
            "allocated_pct": round(self.allocated_pct, 2),
            "idle_gpu_hours_while_waiting": round(self.idle_gpu_hours_while_waiting, 1),
            "waiting_pct_of_time": round(100 * s.waiting_s / self.span_s, 2),
            "mean_queue": round(s.queue_len_s / self.span_s, 2),
            "arrivals": s.arrivals, "placed": s.placed, "gave_up": s.gave_up, "preemptions": s.preemptions,
            "preempting_pods": s.preemptors, "defrag": "on" if self.defrag.enabled else "off",
            "defrag_after_s": self.defrag.after_s, "defrag_budget_per_hour": self.defrag.per_hour,
            "migrations": s.migrations, "moved_pct_of_arrivals": round(self.moved_pct, 3),
            "pods_moved_for": s.migrated_for, "replacements_misplaced": s.misplaced, "prefilled": s.prefilled,
            "prefill_dropped": s.prefill_dropped, "events": s.events,
            "priority_classes": self.priorities, "queueing_delay": self.delay_percentiles(),
            "seconds": round(s.seconds, 2), "placement_seconds": round(s.cycle_seconds, 2),
            "series": [{"t_s": round(p.time, 1), "allocated_pct": round(p.allocated_pct, 2), "queue": p.queue,
                        "fragmented_pct": None if p.fragmented_pct is None else round(p.fragmented_pct, 2)}
                       for p in s.samples],
        }


def node_views(trace: Trace) -> list[NodeView]:
    return [NodeView(spec, None, None, None, False) for spec in trace.nodes]


def trace_pods(trace: Trace, pods_path: Path | None, settings: TimeSettings) -> list[TimedPod]:
    """The trace's pods with lifetimes, patience and priorities (lifetimes.py's rules)."""
    path = pods_path if pods_path is not None else bundled_path(BUNDLED_PODS)
    return timed_pods(trace.pods, read_pod_times(path), horizon_s=settings.horizon_s,
                      default_patience_s=settings.patience_s, seed=settings.seed)


def run_load(trace: Trace, pods: Sequence[TimedPod], profile: WorkloadProfile, settings: TimeSettings,
             load: float, progress: Callable[[float], None] | None = None) -> TimeReport:
    """One run at `load`: the pre-fill, then `settings.duration_s` of Poisson arrivals (one seed stream; with
    `settings.gangs`, a second one picks the gangs, and the rate is lowered so that the offered load stays)."""
    key = [settings.seed, round(load * 1_000_000)]
    rng = np.random.default_rng(key)
    capacity = trace.total_gpus
    rate = arrival_rate(pods, capacity, load)
    policy = build_policy(settings.policy, profile)
    timeline = Timeline(node_views(trace), lambda: policy, seed=settings.seed, defrag=settings.defrag)
    timeline.prefill(prefill(pods, rate, settings.horizon_s, rng))
    gangs = None if settings.gangs is None else TimeGangs(timeline, settings.gangs)
    if gangs is not None:
        rate /= gangs.spec.load_factor(pods)
        arrivals = gangs.arrivals(poisson_arrivals(pods, rate, rng, 0.0, settings.duration_s),
                                  np.random.default_rng([*key, 1]))
    else:
        arrivals = poisson_arrivals(pods, rate, rng, 0.0, settings.duration_s)

    def fragmentation(state: ClusterState) -> float:
        return cluster_fragmentation_milli(state.snapshot, profile)

    stats = timeline.run(arrivals, settings.duration_s, samples=settings.samples,
                         fragmentation=fragmentation if settings.samples else None, progress=progress)
    classes = {p.priority_class: p.request.priority for p in pods}
    return TimeReport(settings.policy, trace.name, settings.seed, load, stats, rate, classes, settings.defrag,
                      settings.gangs, None if gangs is None else gangs.stats)


def workload_profile(trace: Trace) -> WorkloadProfile:
    return WorkloadProfile.from_requests(trace.pods, coverage=0.95, spec_of=trace.spec_of)


