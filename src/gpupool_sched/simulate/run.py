"""Tie a trace, an arrival order and policies together into reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

from gpupool_sched.model.request import PodRequest
from gpupool_sched.placement.fragmentation import WorkloadProfile
from gpupool_sched.placement.registry import POLICIES, build_policy
from gpupool_sched.placement.workload import RollingProfile, typical_gpu_memory_mib
from gpupool_sched.simulate.arrivals import DEFAULT_RATIO, read_event_order, seeded_arrivals
from gpupool_sched.simulate.replay import Progress, replay
from gpupool_sched.simulate.report import BoundReport, SimulationReport, build_report
from gpupool_sched.simulate.trace import Trace

ProfileSource = Literal["trace", "rolling"]
PROFILE_SOURCES: tuple[ProfileSource, ...] = ("trace", "rolling")


@dataclass(frozen=True, slots=True)
class Workload:
    """What every policy of one run sees: the same arrivals and the same tie-break order."""

    arrivals: tuple[PodRequest, ...]
    tie_order: tuple[str, ...] | None
    profile: WorkloadProfile
    seed: int
    event_order: str | None


def prepare_workload(
    trace: Trace, seed: int, event_order: Path | None = None, ratio: float = DEFAULT_RATIO, coverage: float = 0.95
) -> Workload:
    if event_order is not None:
        order = read_event_order(event_order, seed)
        arrivals = order.arrivals(trace.pods, str(event_order))
        ties = order.tie_order([n.name for n in trace.nodes], str(event_order))
        source: str | None = event_order.name
    else:
        capacity = trace.total_gpus * 1000
        arrivals = seeded_arrivals(trace.pods, capacity, seed, ratio)
        ties, source = None, None
    # the target workload FGD defragments for: the trace's own task mix (original pods, not copies)
    profile = WorkloadProfile.from_requests(trace.pods, coverage=coverage, spec_of=trace.spec_of)
    return Workload(tuple(arrivals), tuple(ties) if ties else None, profile, seed, source)


def simulate(
    trace: Trace,
    workload: Workload,
    policies: Sequence[str],
    progress_for: Callable[[str, int], Progress] | None = None,
    *,
    sample_percentage: int | None = None,
    sample_rotate: bool = False,
    profile_source: ProfileSource = "trace",
) -> list[SimulationReport]:
    """One report per policy. ``sample_percentage`` scores a sample of the feasible nodes (None: all,
    0: kube-scheduler's adaptive share; ``sample_rotate``: with kube-scheduler's rotating start);
    ``profile_source="rolling"`` gives profile-driven policies the scheduler's view of the workload
    (a RollingProfile of the arrivals so far) instead of the trace's. Fragmentation is always
    measured against the trace's profile, so reports stay comparable."""
    if profile_source not in PROFILE_SOURCES:
        raise ValueError(f"profile source must be one of {', '.join(PROFILE_SOURCES)}, got {profile_source!r}")
    reports = []
    for name in policies:
        rolling = None
        if profile_source == "rolling" and POLICIES[name].needs_profile:
            rolling = RollingProfile(spec_of=trace.spec_of, typical_gpu_memory_mib=typical_gpu_memory_mib(trace.nodes))
        policy = build_policy(name, rolling.profile() if rolling else workload.profile)
        progress = progress_for(name, len(workload.arrivals)) if progress_for else None
        result = replay(
            trace.nodes,
            workload.arrivals,
            policy,
            workload.profile,
            tie_order=workload.tie_order,
            seed=workload.seed,
            progress=progress,
            sample_percentage=sample_percentage,
            sample_rotate=sample_rotate,
            rolling=rolling,
            rebuild=partial(build_policy, name) if rolling else None,
        )
        reports.append(build_report(result, trace.name, workload.seed, workload.event_order))
    return reports


def bound_report(trace: Trace, workload: Workload, *, config_rounds: int = 0) -> BoundReport:
    """The lower bound on unallocated GPUs, on the arrivals the reports measure at (bound.py)."""
    from gpupool_sched.simulate.bound import lower_bound
    from gpupool_sched.simulate.bound_instance import measured_prefix

    n = measured_prefix(workload.arrivals, trace.total_gpus)
    b = lower_bound(trace.nodes, workload.arrivals[:n], config_rounds=config_rounds)
    return BoundReport(
        trace=trace.name,
        seed=workload.seed,
        event_order=workload.event_order,
        total_gpus=trace.total_gpus,
        pods=n,
        unallocated_pct=b.unallocated_pct,
        unallocated_gpus=round(b.unallocated_milli / 1000, 3),
        max_allocated_milli=b.max_allocated_milli,
        pattern_lp_converged=b.pattern.converged,
        config_lp=None if b.config is None else ("converged" if b.config.converged else "lagrangian"),
        seconds=round(b.seconds, 2),
    )
